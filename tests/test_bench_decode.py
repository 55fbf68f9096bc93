"""The decode scenario's report contract, at tiny sizes on a tiny random model. Speed is recorded, never tested."""

from __future__ import annotations

import dataclasses
import json
import math

from rag_promptcache.bench import run_loaded
from rag_promptcache.bench.common import Bench
from rag_promptcache.bench.report import markdown
from rag_promptcache.engine.decoding.lookup import DEFAULT_LOOKUP
from rag_promptcache.model.loading import dtype_name, resolve_device_dtype
from tests.test_bench import TINY
from tests.tiny import build
import pytest

pytestmark = pytest.mark.slow


def test_decode_rows_and_metadata(tokenizer, tmp_path):
    config = dataclasses.replace(TINY, decode_context=64, decode_tokens=4, dtype="float32")
    bench = Bench(build("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-llama", config, log=lambda _: None)
    result = run_loaded(bench, quick=True, json_path=tmp_path / "bench.json", scenarios=("decode",))
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["dtype"] == "float32" and saved["torch"] and isinstance(saved["cpu_flags"], list)
    rows = saved["decode"]
    assert sorted((r["system"], r["dtype"], r["prompt_lookup"]) for r in rows) == sorted(
        (system, dtype, lookup) for system in ("transformers", "rag-promptcache")
        for dtype in ("float32", "bfloat16") for lookup in (0, DEFAULT_LOOKUP))
    engine_rows = [r for r in rows if r["system"] == "rag-promptcache"]
    assert all(1.0 <= r["tokens_per_forward"] <= 1 + DEFAULT_LOOKUP for r in engine_rows)
    assert all(r["tokens_per_forward"] == 1.0 for r in rows if not r["prompt_lookup"])
    # the random model's 4 tokens in fp32: the same with and without lookup (bf16 may round apart)
    assert [r["tokens_match_no_lookup"] for r in engine_rows if r["prompt_lookup"] and r["dtype"] == "float32"] == [True]
    assert sum(r["default"] for r in rows) == 1
    (default,) = [r for r in rows if r["default"]]
    assert default["system"] == "rag-promptcache" and default["dtype"] == dtype_name(resolve_device_dtype("cpu", None)[1])
    assert default["prompt_lookup"] == DEFAULT_LOOKUP
    # a rate is positive, or None where its seconds were below the clock's resolution (recorded)
    assert 0 < saved["clock_resolution_s"] < 1 and saved["clock_min_span_s"] == 20 * saved["clock_resolution_s"]
    rate = lambda v: v is None or (math.isfinite(v) and v > 0)  # noqa: E731
    for r in rows:
        assert rate(r["tokens_per_s"]) and r["decode_s"] >= 0 and r["new_tokens"] == 4
        assert rate(r["x_transformers_fp32"]) and rate(r["x_transformers_same_dtype"])
    assert all(r["x_transformers_fp32"] in (1.0, None) for r in rows
               if r["system"] == "transformers" and r["dtype"] == "float32" and not r["prompt_lookup"])
    answers = saved["decode_answers"]
    assert answers["questions"] == 4 and [(r["system"], r["prompt_lookup"]) for r in answers["rows"]] == [
        ("rag-promptcache", DEFAULT_LOOKUP), ("rag-promptcache", 0), ("transformers", 0)]
    assert all(rate(r["tokens_per_s"]) and len(r["answer_tokens"]) == 4 for r in answers["rows"])
    assert [r["tokens_per_forward"] for r in answers["rows"][1:]] == [1.0, 1.0] and rate(answers["lookup_speedup"])
    assert answers["rows"][2]["x_transformers_fp32"] in (1.0, None) and [r["default"] for r in answers["rows"]] == [True, False, False]
    assert "## Decode" in markdown(result) and "## Decode on answers" in markdown(result)
