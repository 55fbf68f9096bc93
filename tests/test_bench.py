"""The benchmark runs end to end at tiny sizes on a tiny random model and writes a report with the
contract's fields and sane types. No wall-clock assertions: speed is recorded, never tested."""

from __future__ import annotations

import json
import math

import pytest

from rag_promptcache.bench import run_loaded
from rag_promptcache.bench.common import Bench, BenchConfig, module_texts
from rag_promptcache.engine import DEFAULT_MODE
from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY
from tests.tiny import build

pytestmark = pytest.mark.slow

TINY = BenchConfig(
    contexts=(32, 64), module_tokens=32, warmup=0, repeats_slow=1, repeats_fast=1, questions=2, ks=(2,),
    continuation=4, quality_configs=(("isolated", "none"), ("shared_prefix", "none"), ("shared_prefix", "first_k:2"),
                     ("shared_prefix", DEFAULT_RECOVERY), ("isolated", "selective:1.0")),
    codecs=("native", "int8", "cachegen"), codec_k=2, faiss_sizes=(500,), faiss_queries=3, embed=False, store_repeats=1,
)


@pytest.fixture(scope="module")
def report(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench = Bench(build("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-llama", TINY, log=lambda _: None)
    result = run_loaded(bench, quick=True, json_path=out / "bench.json", plots_dir=out,
                        scenarios=("ttft", "quality", "memory", "throughput"))
    return result, out


def positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def duration(x) -> bool:
    """One span measured inside a call (a TTFT): never negative, and zero where shorter than the clock's step."""
    return isinstance(x, float) and math.isfinite(x) and x >= 0


def rate(x) -> bool:
    """A ratio over such a span: positive, or None where the span was below the clock's resolution."""
    return x is None or positive(x)


def test_modules_are_exactly_the_asked_length(tokenizer):
    for text in module_texts(tokenizer, 5, 32):
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) == 32


def test_report_header_and_files(report):
    result, out = report
    assert result["model"] == "tiny-llama" and result["device"] == "cpu" and result["adapter"] == "none"
    assert result["recovery"] == TINY.recovery  # what --recovery set; None: the engine default
    assert isinstance(result["threads"], int) and result["threads"] >= 1
    assert json.loads((out / "bench.json").read_text())["ttft"] == json.loads(json.dumps(result["ttft"]))
    assert (out / "bench.md").read_text().startswith("# rag-promptcache bench")
    assert (out / "ttft.png").stat().st_size > 0 and (out / "quality_pareto.png").stat().st_size > 0
    assert result["langchain"] == {"skipped": "not run"}


def test_ttft_rows(report):
    rows = report[0]["ttft"]
    assert [r["context_tokens"] for r in rows] == [32, 64] and [r["modules"] for r in rows] == [1, 2]
    for r in rows:
        assert isinstance(r["query_tokens"], int) and r["query_tokens"] > 0
        for key in ("full_s", "prefix_s", "cached_memory_s", "cached_disk_s", "miss_s", "lower_bound_s", "speedup",
                    "overhead_vs_lower_bound", "full_engine_s", "speedup_engine"):
            assert positive(r[key]), (key, r[key])
        assert r["top1_match"] is True  # a tiny llama is exact under relocation
        assert r["cached_path"] in ("cached", "full")
    worst = min(r["speedup_engine"] for r in rows)
    assert f"**{worst:.2f}x**" in (report[1] / "bench.md").read_text()  # the worst ratio is reported


def test_quality_rows(report):
    rows = report[0]["quality"]
    codec_mode = DEFAULT_MODE  # the codec rows use the engine's default mode
    assert {(r["mode"], r["codec"]) for r in rows} >= {("isolated", "native"), ("shared_prefix", "native"),
                                                        (codec_mode, "int8")}
    assert sum(r["default"] for r in rows) == 1
    for r in rows:
        assert r["questions"] == 2 and r["k"] == 2 and isinstance(r["recovery"], str)
        assert isinstance(r["budget"], float)
        for key in ("top1_agreement", "greedy_exact_match"):
            assert 0.0 <= r[key] <= 1.0
        assert r["mean_kl"] >= -1e-6 and positive(r["nll_full"]) and positive(r["nll_cached"])
    everything = [r for r in rows if r["recovery"].startswith("selective:1")]
    if everything:  # recomputing every token is full prefill: the scoring path must see no difference
        (r,) = everything
        assert r["top1_agreement"] == 1.0 and r["greedy_exact_match"] == 1.0 and r["mean_kl"] < 1e-4


def test_memory_and_throughput(report):
    result = report[0]
    by_codec = {r["codec"]: r for r in result["memory"]}
    assert set(by_codec) == {"native", "int8", "cachegen"}
    native = by_codec["native"]
    assert native["bytes_per_token"] == native["formula_bytes_per_token"]  # fp32, no codec overhead
    assert by_codec["int8"]["formula_bytes_per_token"] <= by_codec["int8"]["bytes_per_token"] < native["bytes_per_token"]
    cachegen = by_codec["cachegen"]
    # smaller than int8 even at this toy geometry; the third of int8 on SmolLM2 is test_cachegen's
    assert cachegen["formula_bytes_per_token"] is None and cachegen["bytes_per_token"] < by_codec["int8"]["bytes_per_token"]
    assert all(positive(r["encode_s"]) and positive(r["decode_s"]) for r in by_codec.values())
    assert positive(result["store_tiers"]["recompute_s"]) and positive(result["store_tiers"]["memory_native_s"])
    thr = result["throughput"]
    assert thr["encode"] and rate(thr["encode"][0]["tokens_per_s"])
    # the mean over repeated searches spans enough of the clock; one search alone may not (then None)
    assert thr["faiss"][0]["vectors"] == 500 and positive(thr["faiss"][0]["search_ms_mean"])
    assert rate(thr["faiss"][0]["search_ms_median"])
    assert "skipped" in thr["embed"]


# -- fidelity: the plumbing on a tiny random model (its answers are noise; accuracy is not checked) --

FIDELITY = BenchConfig(
    repeats_slow=1, fidelity_per_kind=1, fidelity_questions=3, fidelity_ks=(2, 3), fidelity_new_tokens=3, fidelity_ttft_context=200,
    fidelity_ttft_questions=1, fidelity_settings=(("shared_prefix", "none"), ("isolated", "last:1"),
                                                  ("shared_prefix", "last:9")),
    fidelity_codecs=("int4",), fidelity_codec_recovery="none",
)


@pytest.fixture(scope="module")
def fidelity_report(tokenizer, tmp_path_factory):
    out = tmp_path_factory.mktemp("fidelity")
    bench = Bench(build("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-llama", FIDELITY, log=lambda _: None)
    return run_loaded(bench, quick=True, json_path=out / "bench.json", plots_dir=out, scenarios=("fidelity",)), out


def test_fidelity_rows_and_files(fidelity_report):
    result, out = fidelity_report
    fid = result["fidelity"]
    assert fid["retrieval"] == "dense"  # the base model's reference runs judged dense retrieval's prompts
    assert fid["neighbours"] == 0  # modules encoded alone unless --neighbours asks
    rows = fid["rows"]
    assert FIDELITY.fidelity_splits == ("bench", "heldout", "manuals")  # all by default: chosen on one, confirmed on the others
    assert [(r["split"], r["k"], r["mode"], r["recovery"]) for r in rows] == [
        (s, k, m, r) for s in FIDELITY.fidelity_splits for k in (2, 3) for m, r in FIDELITY.fidelity_settings]
    for r in rows:
        assert r["questions"] == r["with_answer"] == 3
        assert 0 <= r["cached_correct"] <= 3 and 0 <= r["full_correct"] <= 3 and 0.0 <= r["agreement"] <= 1.0
        assert duration(r["full_ttft_s"]) and duration(r["cached_ttft_s"]) and rate(r["speedup"])
    # every module recomputed (k <= 9): the same tokens as full prefill, so the same greedy answers
    assert all(r["agreement"] == 1.0 for r in rows if r["recovery"] == "last:9")
    assert {t["recovery"] for t in fid["ttft_at_context"]} == {"none", "last:1", "last:9"}
    assert all(t["k"] >= 2 and rate(t["speedup"]) for t in fid["ttft_at_context"])
    # a codec row per split and k, fp16 modules the reference
    codec_rows = fid["codec_rows"]
    assert [(r["split"], r["k"], r["codec"]) for r in codec_rows] == [
        (s, k, c) for s in FIDELITY.fidelity_splits for k in (2, 3) for c in ("fp16", "int4")]
    assert all(r["recovery"] == "none" and r["questions"] == 3 for r in codec_rows)
    # fp16's row is judged against itself (the tiny model's answers are noise: none may be right)
    assert all(r["agreement"] == 1.0 and r["cached_correct"] == r["fp16_correct"] for r in codec_rows if r["codec"] == "fp16")
    md = (out / "bench.md").read_text()
    assert "## Answer fidelity" in md and "| heldout | 3 |" in md and "on every split at every k" in md
    assert "fp16 modules right" in md and "| int4 |" in md
    assert (out / "fidelity.png").stat().st_size > 0 and (out / "fidelity_front.png").stat().st_size > 0
    assert json.loads((out / "bench.json").read_text())["fidelity"]["rows"] == json.loads(json.dumps(rows))


def test_choose_default_follows_the_rule():
    from rag_promptcache.bench.fidelity import choose_default

    def row(rec, k, kept, retained=1.0):  # the rule reads both: retained >= 0.95 and kept (paired) >= 0.90
        return {"mode": "shared_prefix", "recovery": rec, "k": k, "kept": kept, "retained": retained}

    def at(rec, speedup):
        return {"mode": "shared_prefix", "recovery": rec, "speedup": speedup}

    rows = [row("none", 4, 0.3), row("none", 12, 0.2), row("a", 4, 0.91), row("a", 8, 0.5), row("a", 12, 1.0),
            row("b", 4, 1.0), row("b", 12, 0.97), row("c", 4, 1.0), row("c", 12, 1.0), row("d", 4, 0.92, 0.94),
            row("d", 12, 1.0)]
    timing = [at("none", 20.0), at("a", 9.0), at("b", 6.0), at("c", 2.0), at("d", 10.0)]
    assert choose_default(rows, timing)["recovery"] == "a"  # k=8 is not one of the two ends; d retains too little
    timing = [at("none", 20.0), at("a", 4.0), at("b", 3.5), at("c", 2.0)]
    chosen = choose_default(rows, timing)  # none reaches 5x: the most faithful keeping 3x
    assert chosen["recovery"] == "b" and "most faithful" in chosen["rule"]
    assert choose_default(rows, [at("none", 2.0), at("a", 2.0), at("b", 2.0), at("c", 2.0)]) is None


def test_fidelity_settings_option_reads_mode_and_recovery():
    from rag_promptcache.bench.cli import _settings

    assert _settings("none, isolated/last:2,last:2,none") == (
        ("shared_prefix", "none"), ("isolated", "last:2"), ("shared_prefix", "last:2"))
    for bad, says in (("nope/none", "encoding mode"), ("bogus", "recovery"), (" , ", "settings like")):
        with pytest.raises(ValueError, match=says):
            _settings(bad)
