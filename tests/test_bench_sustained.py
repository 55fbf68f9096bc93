"""The sustained scenario (bench/sustained.py) at tiny size on a tiny random model, on the memory, disk and
Redis tiers: its store checks pass (budgets, entries, the prefix cache, steady reuse), and its report, table
and plot carry them. Speed is recorded, never asserted: a tiny model's TTFT is the clock's noise."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from rag_promptcache.bench import run_loaded
from rag_promptcache.bench.common import Bench, BenchConfig
from rag_promptcache.bench.sustained import hit_rates, window
from tests.store_helpers import needs_redis
from tests.tiny import build

pytestmark = pytest.mark.slow

TINY = dataclasses.replace(
    BenchConfig(), recovery="none", sustained_modules=24, sustained_module_tokens=64, sustained_k=4,
    sustained_questions=60, sustained_warmup=6, sustained_window=25, sustained_every=6,
    sustained_judge_s=float("inf"),  # a tiny model's TTFT is the machine's noise: the speed-up is not judged
)


@pytest.fixture
def one_thread():
    """A tiny model's forwards are too small for two threads: on a loaded machine their barriers cost more
    than the work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@needs_redis
def test_sustained_runs_on_memory_disk_and_redis_with_its_checks(tokenizer, tmp_path, one_thread):
    bench = Bench(build("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-llama", TINY, log=lambda _: None)
    result = run_loaded(bench, quick=True, json_path=tmp_path / "bench.json", plots_dir=tmp_path,
                        scenarios=("sustained",))
    out = result["sustained"]
    assert [r["tiers"] for r in out["runs"]] == ["memory", "memory+disk", "memory+redis"]
    assert out["passed"] is True
    for run in out["runs"]:
        checks = run["checks"]
        for name in ("budgets", "entries", "prefix", "reuse_steady"):
            assert checks[name]["passed"] is True, (run["tiers"], name, checks[name])
        assert checks["speedup_steady"]["passed"] is None
        assert {r["path"] for r in run["rows"]} == {"cached"}  # never the clock's choice of path: reuse is judged
        assert len(run["rows"]) == 66 and sum(r["full_s"] is not None for r in run["rows"]) == 33
        tiers = set(run["budgets"])
        assert tiers == {"memory", *({"disk"} if "disk" in run["tiers"] else ()),
                         *({"redis"} if "redis" in run["tiers"] else ())}
        # the corpus is four times the memory tier: it must have evicted, and still served from it
        assert run["rows"][-1]["tiers"]["memory"]["entries"] < 24 / 2
        assert 0 < run["last"]["module_hit_rate"] <= 1 and run["first"]["questions"] == [6, 30]
        points = hit_rates(run["rows"], 6)
        assert len(points) == 11 and all(0 <= p["any"] <= 1 for p in points)
    disk = out["runs"][1]
    assert max(r["tiers"]["disk"]["entries"] for r in disk["rows"]) < 24  # its budget is half the corpus
    assert json.loads((tmp_path / "bench.json").read_text())["sustained"]["passed"] is True
    assert "## Sustained: 60 novel questions" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "sustained.png").stat().st_size > 0


def test_a_window_averages_times_and_skips_untimed_full_prefills():
    rows = [{"question": i, "cached_s": 0.1, "full_s": 0.4 if i % 2 == 0 else None, "hits": 3, "misses": 1,
             "cached_tokens": 30, "prompt_tokens": 40, "path": "cached"} for i in range(4)]
    w = window(rows)
    assert w["speedup"] == pytest.approx(4.0) and w["served_share"] == pytest.approx(0.75)
    assert w["module_hit_rate"] == pytest.approx(0.75) and w["questions"] == [0, 3]
    rows = [dict(r, cached_s=0.0) for r in rows]  # a clock that never stepped: no speed-up, not infinity
    assert window(rows)["speedup"] is None
