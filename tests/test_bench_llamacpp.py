"""llama.cpp as a bench baseline (bench/llamacpp.py, bench/chat.py).

Without llama-cpp-python: the bf16 GGUF conversion on a tiny GGUF written here (metadata copied, file
type and tensor types changed, shapes kept, values the bf16 rounding of the dequantized source, one
cached file per source), the chat scenario's shape on a tiny random model (no llama.cpp rows for a
model whose GGUF is unknown). With it (skipped otherwise): llama.cpp on the bf16 and Q4_1 GGUFs of
the default model agrees with our model's top-1, and prefix reuse gives what full prefill gives.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from rag_promptcache.bench import llamacpp  # noqa: E402
from rag_promptcache.bench.common import Bench, BenchConfig  # noqa: E402

needs_llama_cpp = pytest.mark.skipif(not llamacpp.available(),
                                     reason=f"llama-cpp-python is not installed: {llamacpp.INSTALL_HINT}")
Q = gguf.GGMLQuantizationType


def tiny_gguf(path) -> dict[str, np.ndarray]:
    """A small llama-shaped GGUF: a Q4_1 matrix, a Q8_0 embedding, an F32 matrix and an F32 norm,
    metadata of every kind the real file carries. Returns the dequantized values by tensor name."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 100000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_array("tokenizer.ggml.tokens", ["<a>", "<b>", "c"])
    w.add_key_value("tokenizer.ggml.token_type", [3, 3, 1], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_uint32("general.file_type", 3)
    values = {}
    for name, shape, qtype in (("blk.0.attn_q.weight", (8, 64), Q.Q4_1), ("token_embd.weight", (16, 64), Q.Q8_0),
                               ("blk.0.ffn_down.weight", (4, 32), Q.F32), ("blk.0.attn_norm.weight", (64,), Q.F32)):
        x = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, x)
            values[name] = x
        else:
            data = gguf.quants.quantize(x, qtype)
            w.add_tensor(name, data, raw_dtype=qtype)
            values[name] = gguf.quants.dequantize(data, qtype).reshape(shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def test_bf16_conversion_keeps_metadata_shapes_and_values(tmp_path):
    src, dst = tmp_path / "tiny.Q4_1.gguf", tmp_path / "tiny.bf16.gguf"
    values = tiny_gguf(src)
    llamacpp.to_bf16(src, dst)
    a, b = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    assert set(a.fields) == set(b.fields)
    for name, field in a.fields.items():
        if name == "general.file_type":
            assert b.fields[name].contents() == int(gguf.LlamaFileType.MOSTLY_BF16)
        elif not name.startswith("GGUF."):
            assert b.fields[name].types == field.types, name
            assert b.fields[name].contents() == field.contents(), name
    tensors = {t.name: t for t in b.tensors}
    assert [t.name for t in b.tensors] == [t.name for t in a.tensors]
    for t in a.tensors:
        out = tensors[t.name]
        assert list(out.shape) == list(t.shape), t.name
        expect = torch.from_numpy(values[t.name])
        if expect.ndim == 1:  # norms stay F32, as llama.cpp's converter keeps them
            assert out.tensor_type == Q.F32
            got = torch.from_numpy(np.array(out.data)).reshape(expect.shape)
            assert torch.equal(got, expect)
        else:
            assert out.tensor_type == Q.BF16
            got = torch.from_numpy(gguf.quants.dequantize(out.data, out.tensor_type)).reshape(expect.shape)
            # the bf16 our engine gets when it casts the same dequantized weights
            assert torch.equal(got, expect.to(torch.bfloat16).float()), t.name


def test_bf16_gguf_converts_once_per_source(tmp_path):
    src = tmp_path / "tiny.Q4_1.gguf"
    tiny_gguf(src)
    first = llamacpp.bf16_gguf(src, tmp_path / "cache")
    stamp = first.stat().st_mtime_ns
    assert llamacpp.bf16_gguf(src, tmp_path / "cache") == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temporary file left
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))  # a changed source converts again, under a new name
    assert llamacpp.bf16_gguf(src, tmp_path / "cache") != first


def test_common_prefix():
    assert llamacpp.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert llamacpp.common_prefix([], [1]) == 0 and llamacpp.common_prefix([1, 2], [1, 2]) == 2


@pytest.mark.slow
def test_chat_scenario_without_llama_cpp_rows(tokenizer):
    from rag_promptcache.bench import chat
    from tests.tiny import build

    cfg = BenchConfig(module_tokens=32, chat_turns=3, chat_context=64, chat_answer_tokens=4, chat_repeats=2)
    out = chat.run(Bench(build("llama", vocab_size=len(tokenizer)), tokenizer, "tiny-llama", cfg, log=lambda _: None))
    rows = out["rows"]
    assert [(r["repeat"], r["turn"]) for r in rows] == [(rep, t) for rep in range(2) for t in (1, 2, 3)]
    assert all(r["prompt_tokens"] < s["prompt_tokens"] for r, s in zip(rows, rows[1:]) if s["turn"] > 1)
    assert not any(k.startswith("llamacpp") for r in rows for k in r) and "x_llamacpp_bf16" not in out
    assert out["engine_median_s"] >= 0 and out["modules"] == 2


@needs_llama_cpp
@pytest.mark.slow
def test_llama_cpp_matches_our_model_and_reuse_matches_full(smollm):
    model, tok = smollm
    paths = llamacpp.default_ggufs()
    ids = tok("The capital of France is Paris. The capital of Italy is", add_special_tokens=False)["input_ids"]
    check = llamacpp.logit_check(paths["bf16"], model, ids)
    assert check.ok, check
    runner = llamacpp.Runner(paths["bf16"], n_ctx=512, threads=1)
    long = tok(" ".join(["The assert statement checks a condition."] * 20), add_special_tokens=False)["input_ids"]
    other = long[:100] + tok(" Something else entirely.", add_special_tokens=False)["input_ids"]
    _, first_full = runner.full(other)
    runner.full(long)
    _, first_reuse, reused = runner.reuse(other)
    assert reused == 100 and first_reuse == first_full and runner.state == other
    _, _, again = runner.reuse(other)  # all of it cached: the last token is evaluated again for its logits
    assert again == len(other) - 1
    _, _, greedy = runner.decode(long, 8)
    runner.full(long)
    stepwise = [runner.greedy()]
    for _ in range(7):
        runner.extend([stepwise[-1]])
        stepwise.append(runner.greedy())
    assert greedy == stepwise
    assert llamacpp.token_check(runner, tok, long)["identical"]


@needs_llama_cpp
@pytest.mark.slow
def test_decode_rows_shape(smollm):
    model, tok = smollm
    cfg = dataclasses.replace(BenchConfig(), decode_tokens=4, repeats_slow=1, llamacpp_threads=1)
    bench = Bench(model, tok, "smollm2-135m-instruct", cfg, log=lambda _: None)
    ids = tok("Explain the assert statement.", add_special_tokens=False)["input_ids"]
    rows = llamacpp.decode_rows(bench, ids, [{"system": "transformers", "dtype": "float32", "prompt_lookup": 0,
                                              "tokens_per_s": 10.0}])
    assert [(r["system"], r["dtype"]) for r in rows] == [("llama.cpp", "bfloat16"), ("llama.cpp", "q4_1")]
    for r in rows:
        assert r["new_tokens"] == 4 and (r["tokens_per_s"] is None or r["x_transformers_fp32"] == r["tokens_per_s"] / 10.0)
    assert all(c["top1_matches"] == c["positions"] for c in bench.extras["llamacpp_check"].values())
