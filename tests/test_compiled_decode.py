"""The compiled static decode step (engine/static_decode.py) against the eager lean step, on tiny
random Llamas: equal logits, equal greedy text, no recompiles as positions advance, one graph per
capacity bucket, and a clean eager fallback when compiling fails (a real missing compiler)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.assemble import _POOL, ReservedLayer
from rag_promptcache.engine.decode import forward_last, lean_forward
from rag_promptcache.engine.static_decode import ENV, StaticDecoder, bucket, compile_mode, is_bucket, static_decoder
from rag_promptcache.model.positions import kv_geometry
from tests.tiny import ARCHS
from tests.tiny_llama import save_tiny_llama

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ARCHS["llama"](), attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def _prefilled(model, ids: torch.Tensor, capacity: int):
    """A reserved cache of exactly `capacity` (not from the pool, which may hand out a larger one)."""
    g = kv_geometry(model)
    cache = DynamicCache(config=model.config)
    shape = (1, g.num_kv_heads, capacity, g.head_dim)
    cache.layers[:] = [ReservedLayer(torch.full(shape, float("nan")), torch.full(shape, float("nan")), 0)
                       for _ in range(g.num_layers)]  # NaN: unwritten slots must never leak into attention
    logits = forward_last(model, ids, torch.arange(ids.shape[1])[None], cache)
    return cache, logits


def test_buckets_are_few_and_hold_the_request():
    assert [bucket(n) for n in (1, 256, 257, 600, 1025, 2240, 3073, 8192)] == [256, 256, 512, 768, 1536, 3072, 4096, 8192]
    assert all(bucket(n) >= n and bucket(n) % 256 == 0 and bucket(n) < 2 * n + 256 for n in range(1, 20000, 37))
    assert len({bucket(n) for n in range(1, 8193)}) == 10  # graphs for an 8k window, at most
    assert is_bucket(1536) and not is_bucket(1280) and not is_bucket(100)


def test_compile_mode_from_argument_and_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert compile_mode(None) is None and compile_mode(False) is None and compile_mode(True) == "default"
    monkeypatch.setenv(ENV, "1")
    assert compile_mode(None) == "default" and compile_mode(False) is None
    monkeypatch.setenv(ENV, "freezing")
    assert compile_mode(None) == "freezing"
    monkeypatch.setenv(ENV, "fast please")
    with pytest.raises(ValueError, match="valid: True/1"):
        compile_mode(None)
    with pytest.raises(ValueError, match="max-autotune-no-cudagraphs"):
        compile_mode("turbo")


def test_static_step_equals_eager_lean_step_without_recompiling(tiny):
    """60 steps: the eager static step (mode=None), the compiled one and LeanLlama's own step agree."""
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (1, 40))
    eager_cache, first = _prefilled(tiny, ids, 256)
    caches = {m: _prefilled(tiny, ids, 256)[0] for m in (None, "default")}
    decoders = {m: StaticDecoder(lean_forward(tiny), m) for m in caches}
    counters.clear()
    token = int(first.argmax())
    worst = 0.0
    for i in range(60):
        position = 40 + i
        ref = forward_last(tiny, torch.tensor([[token]]), torch.tensor([[position]]), eager_cache)
        for mode, decoder in decoders.items():
            got = decoder.step(token, position, caches[mode])
            worst = max(worst, float((got - ref).abs().max()))
        token = int(ref.argmax())
    assert worst < 1e-4, f"{worst=}"
    assert decoders["default"].compiled and decoders["default"].capacities == {256}
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["recompiles"], dict(counters["recompiles"])
    for mode, cache in caches.items():  # the cache records what was written, as the eager step's does
        assert cache.layers[0].length == eager_cache.layers[0].length == 100
        assert torch.allclose(cache.layers[1].keys, eager_cache.layers[1].keys, atol=1e-5)


def test_engine_greedy_text_is_identical_and_buckets_share_graphs(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    _POOL.clear()  # buffers other tests left may be larger than a bucket: those requests would run eagerly
    eager = PromptCache(model, tok, compile=False)
    fast = PromptCache(model, tok, compile=True)
    assert eager.decoder is None and fast.decoder is static_decoder(model, True)  # one per model and mode
    assert fast.warm_decode(300) > 0 and fast.decoder.capacities == {512}
    assert fast.warm_decode(400) == 0.0  # the same bucket: nothing to compile
    schema = '<schema name="s"><module name="a">' + "alpha beta gamma " * 80 + "</module></schema>"
    for engine in (eager, fast):
        engine.add_schema(schema)
    prompts = ['<prompt schema="s"><a/>Question one?</prompt>',
               '<prompt schema="s"><a/>A longer question two, about delta?</prompt>']
    counters.clear()
    for prompt in prompts:  # both requests fit the warmed 512 bucket: no compile in either
        want = eager.generate(prompt, max_new_tokens=60, ignore_eos=True)
        got = fast.generate(prompt, max_new_tokens=60, ignore_eos=True)
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.prompt_tokens + 60 <= 512
    assert counters["stats"].get("unique_graphs", 0) == 0 and not counters["recompiles"]
    # a longer answer needs the 768 bucket: exactly one more graph
    long = fast.generate(prompts[0], max_new_tokens=400, ignore_eos=True)
    assert long.token_ids == eager.generate(prompts[0], max_new_tokens=400, ignore_eos=True).token_ids
    assert fast.decoder.capacities == {512, 768}, fast.decoder.capacities


def test_a_missing_compiler_falls_back_to_the_eager_step(tiny_dir, tmp_path):
    """In a process whose C++ compiler does not exist: one warning, then the same tokens as eager."""
    script = textwrap.dedent(f"""
        import logging, torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
        from rag_promptcache.engine import PromptCache
        logging.basicConfig(level=logging.WARNING)
        model = AutoModelForCausalLM.from_pretrained({tiny_dir!r}).eval()
        tok = AutoTokenizer.from_pretrained({tiny_dir!r})
        fast, eager = PromptCache(model, tok, compile=True), PromptCache(model, tok, compile=False)
        for engine in (fast, eager):
            engine.add_schema('<schema name="s"><module name="a">one two three</module></schema>')
        prompt = '<prompt schema="s"><a/>Four?</prompt>'
        got = [fast.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids for _ in range(2)]
        want = eager.generate(prompt, max_new_tokens=20, ignore_eos=True).token_ids
        assert got == [want, want], (got, want)
        assert fast.decoder.error and not fast.decoder.compiled, fast.decoder.error
        print("FELL BACK:", fast.decoder.error)
    """)
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop(ENV, None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FELL BACK:" in out.stdout
    assert out.stderr.count("decoding eagerly from now on") == 1, out.stderr[-3000:]


def test_models_without_a_lean_forward_decode_eagerly():
    torch.manual_seed(0)
    qwen = AutoModelForCausalLM.from_config(ARCHS["qwen2"]()).eval()
    assert static_decoder(qwen, True) is None


def test_bench_decode_has_a_compiled_row_with_its_mode(tokenizer, tmp_path, monkeypatch):
    import dataclasses
    import json

    from rag_promptcache.bench import run_loaded
    from rag_promptcache.bench.common import Bench
    from tests.test_bench import TINY
    from tests.tiny import build

    monkeypatch.delenv(ENV, raising=False)
    config = dataclasses.replace(TINY, decode_context=64, decode_tokens=4, dtype="float32",
                                 decode_dtypes=("float32",), decode_compile="default")
    bench = Bench(build("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-llama", config, log=lambda _: None)
    run_loaded(bench, quick=True, json_path=tmp_path / "bench.json", scenarios=("decode",))
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["compile"] == "off" and saved["decode_compile"] == "default"
    rows = {r["system"]: r for r in saved["decode"]}
    assert set(rows) == {"transformers", "rag-promptcache", "rag-promptcache-compiled"}
    fast = rows["rag-promptcache-compiled"]
    assert fast["compile"] == "default" and fast["compile_s"] > 0 and fast["graphs"] >= 1
    assert fast["compile_error"] is None and fast["tokens_match_eager"] is True and not fast["default"]
    from rag_promptcache.model.loading import resolve_device_dtype

    # the engine's default row is the eager one, when the device's default dtype is the one run here
    assert rows["rag-promptcache"]["compile"] == "off"
    assert rows["rag-promptcache"]["default"] == (resolve_device_dtype("cpu", None)[1] == torch.float32)
