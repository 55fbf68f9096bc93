"""The native decode step (engine/compute/native_step.py, model/kernels/decode_step.c) against the torch forward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from rag_promptcache.engine.compute import attention
from rag_promptcache.engine.kv.assemble import reserved_cache
from rag_promptcache.engine.batching.batch import BatchCache, decode_step
from rag_promptcache.engine.compute.native_step import MAX_NEW
from rag_promptcache.engine.compute.runner import forward_logits
from rag_promptcache.model import native
from rag_promptcache.model.positions import kv_geometry
from tests.tiny import ARCHS

needs_kernel = pytest.mark.skipif(not attention.available(), reason="no avx512_bf16 CPU or no C compiler here")

SHAPES = {
    "blocks": {},  # hidden 64: every product runs in 16-row blocks
    "tails": {"hidden_size": 48, "intermediate_size": 72, "vocab_size": 100},  # rows and columns left over
    "dim32": {"hidden_size": 128, "intermediate_size": 256},  # head_dim 32: scores 16 keys at a time
}


def _tiny(dtype=torch.bfloat16, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(ARCHS["llama"](**overrides), attn_implementation="sdpa").to(dtype).eval()


@pytest.fixture
def calls(monkeypatch):
    """How many times the kernel ran (a wrapper around the loaded library's function)."""
    lib = native.library()
    count = []
    if lib is not None:
        inner = lib.llama_decode_bf16

        def spy(*args):
            rc = inner(*args)
            count.append(rc)
            return rc

        monkeypatch.setattr(lib, "llama_decode_bf16", spy)
    return count


def _steps(model, ids: torch.Tensor, capacity: int = 64):
    """24 cached tokens, then a 1-token step, prompt lookup checks of 2 and 5 tokens (attention per
    token, and in row blocks) keeping every row, and one more token → (the logits, the cache's KV)."""
    cache, keys, values = reserved_cache(model.config, kv_geometry(model), capacity, model.dtype, model.device)
    forward_logits(model, ids[:, :24], torch.arange(24)[None], cache)
    out = [forward_logits(model, ids[:, 24:25], torch.tensor([[24]]), cache),
           forward_logits(model, ids[:, 25:27], torch.arange(25, 27)[None], cache, keep=2),
           forward_logits(model, ids[:, 27:32], torch.arange(27, 32)[None], cache, keep=5),
           forward_logits(model, ids[:, 32:33], torch.tensor([[32]]), cache)]
    assert all(layer.length == 33 for layer in cache.layers)
    return out, keys[:, :, :33].clone(), values[:, :, :33].clone()


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_native_step_equals_the_torch_forward_to_rounding(shape, calls, monkeypatch):
    model = _tiny(**SHAPES[shape])
    ids = torch.randint(0, model.config.vocab_size, (1, 40))
    fast, fast_k, fast_v = _steps(model, ids)
    assert calls == [0, 0, 0, 0], "the kernel ran each step once, and only the steps"
    monkeypatch.setenv(native.KERNELS_ENV, "0")
    ref, ref_k, ref_v = _steps(model, ids)
    for a, b in zip(fast, ref):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert torch.allclose(a, b, atol=2e-2, rtol=0), f"{(a - b).abs().max()=}"
    assert torch.allclose(fast_k.float(), ref_k.float(), atol=2e-2, rtol=0)
    assert torch.allclose(fast_v.float(), ref_v.float(), atol=2e-2, rtol=0)


@needs_kernel
def test_native_step_leaves_to_torch_what_it_does_not_cover(calls):
    model = _tiny()
    ids = torch.randint(0, 128, (1, 300))
    cache, keys, _ = reserved_cache(model.config, kv_geometry(model), 256, model.dtype, model.device)
    assert keys.shape[-2] == 256
    forward_logits(model, ids[:, :248], torch.arange(248)[None], cache)  # a prefill of more than MAX_NEW tokens
    assert 248 > MAX_NEW and calls == []
    mask = torch.zeros(1, 1, 2, 250, dtype=model.dtype)
    mask[..., 200:248] = torch.finfo(model.dtype).min
    forward_logits(model, ids[:, 248:250], torch.arange(248, 250)[None], cache, mask, keep=2)  # a mask
    assert calls == []
    # 7 more tokens than the buffers hold: the torch forward grows them
    forward_logits(model, ids[:, 250:263], torch.arange(250, 263)[None], cache, keep=1)
    assert calls == [] and all(layer.length == 263 for layer in cache.layers)
    forward_logits(model, ids[:, 263:264], torch.tensor([[263]]), cache)  # room again: the kernel
    assert calls == [0] and all(layer.length == 264 for layer in cache.layers)
    fp32 = _tiny(torch.float32)
    cache, _, _ = reserved_cache(fp32.config, kv_geometry(fp32), 32, fp32.dtype, fp32.device)
    forward_logits(fp32, ids[:, :1], torch.tensor([[0]]), cache)  # fp32: never
    assert calls == [0]


@needs_kernel
@pytest.mark.smollm
def test_smollm2_bf16_native_step_is_as_close_to_fp32_as_torch(smollm, monkeypatch):
    """Teacher-forced one-token steps after a 700-token context: the kernel's logits differ from fp32
    by no more than the torch bf16 forward's do."""
    model, tokenizer = smollm
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    from pydoc_data.topics import topics  # text that does not change as this project's docs do

    text = "".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :732]

    def steps(m) -> torch.Tensor:
        cache, _, _ = reserved_cache(m.config, kv_geometry(m), 800, m.dtype, m.device)
        forward_logits(m, ids[:, :700], torch.arange(700)[None], cache)
        return torch.stack([forward_logits(m, ids[:, i : i + 1], torch.tensor([[i]]), cache)[-1]
                            for i in range(700, 732)])

    fp32 = steps(model)
    fast = steps(bf16)
    monkeypatch.setenv(native.KERNELS_ENV, "0")
    ref = steps(bf16)

    def kl(x: torch.Tensor) -> float:
        return F.kl_div(x.log_softmax(-1), fp32.log_softmax(-1), log_target=True, reduction="sum").item()

    assert kl(fast) <= 1.5 * kl(ref) + 1e-3, f"{kl(fast)=} {kl(ref)=}"
    agree_fast = (fast.argmax(-1) == fp32.argmax(-1)).sum().item()
    agree_ref = (ref.argmax(-1) == fp32.argmax(-1)).sum().item()
    assert agree_fast >= agree_ref - 1, f"{agree_fast=} {agree_ref=} of 32"


@pytest.fixture
def batch_calls(monkeypatch):
    """How many times the batch kernel ran."""
    lib = native.library()
    count = []
    if lib is not None:
        inner = lib.llama_decode_batch_bf16

        def spy(*args):
            rc = inner(*args)
            count.append(rc)
            return rc

        monkeypatch.setattr(lib, "llama_decode_batch_bf16", spy)
    return count


def _batched(model, prompts: list[torch.Tensor], steps: int = 3):
    """Rows of different lengths loaded into a batch cache, then `steps` batched decode steps (each
    row's next input its own argmax) → the logits of every step [steps, B, V], the rows' KV."""
    batch = BatchCache(model.config, kv_geometry(model), len(prompts), 64, model.dtype, model.device)
    last = []
    for row, ids in enumerate(prompts):
        cache, _, _ = reserved_cache(model.config, kv_geometry(model), 64, model.dtype, model.device)
        last.append(forward_logits(model, ids, torch.arange(ids.shape[1])[None], cache)[-1])
        batch.load(row, cache)
    out = []
    for _ in range(steps):
        ids = [int(x.argmax()) for x in last]
        positions = batch.lengths[: len(prompts)]
        logits = decode_step(model, batch, ids, list(positions))
        out.append(logits)
        last = list(logits)
    n = max(batch.lengths)
    return torch.stack(out), batch.keys[:, :, :, :n].clone(), batch.values[:, :, :, :n].clone(), list(batch.lengths)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_batched_native_step_equals_the_torch_batch_to_rounding(shape, batch_calls, monkeypatch):
    model = _tiny(**SHAPES[shape])
    prompts = [torch.randint(0, model.config.vocab_size, (1, n)) for n in (5, 23, 1, 40)]  # one length each
    fast, fast_k, fast_v, lengths = _batched(model, prompts)
    assert batch_calls == [0, 0, 0], "one kernel call per batched step"
    monkeypatch.setenv(native.KERNELS_ENV, "0")
    ref, ref_k, ref_v, ref_lengths = _batched(model, prompts)
    assert lengths == ref_lengths == [8, 26, 4, 43]
    assert fast.shape == ref.shape and torch.allclose(fast, ref, atol=2e-2, rtol=0), f"{(fast - ref).abs().max()=}"
    for row, n in enumerate(lengths):  # each row's KV up to its length (the slots past it are not read)
        assert torch.allclose(fast_k[:, row, :, :n].float(), ref_k[:, row, :, :n].float(), atol=2e-2, rtol=0)
        assert torch.allclose(fast_v[:, row, :, :n].float(), ref_v[:, row, :, :n].float(), atol=2e-2, rtol=0)
