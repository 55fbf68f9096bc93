"""The lean Llama forward (engine/compute/forward.py) against transformers' forward, and the KV buffer pool."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.kv.assemble import _POOL, assemble, reserved_cache
from rag_promptcache.engine.compute.runner import forward_last, lean_forward
from rag_promptcache.engine.compute.forward import PACK_ENV, LeanLlama, can_pack
from rag_promptcache.model.rotary import apply_rotary_pos_emb
from rag_promptcache.model import native
from rag_promptcache.model.positions import kv_geometry
from tests.tiny import ARCHS, build

ROOT = Path(__file__).resolve().parents[1]


def _tiny(arch: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(ARCHS[arch](), attn_implementation="sdpa").to(dtype).eval()
    return model


def _filled(model, num_cached: int, capacity: int, ids: torch.Tensor) -> DynamicCache:
    cache, _, _ = reserved_cache(model.config, kv_geometry(model), capacity, model.dtype, model.device)
    forward_last(model, ids[:, :num_cached], torch.arange(num_cached)[None], cache, lean=False)
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_equals_transformers_prefill_mask_and_decode(dtype):
    model = _tiny("llama", dtype)
    assert lean_forward(model) is not None
    ids = torch.randint(0, 128, (1, 40))
    for lean in (True, False):
        # a prefill of 10 tokens after 24 cached (plain causal), then one decode step
        cache = _filled(model, 24, 64, ids)
        got = forward_last(model, ids[:, 24:34], torch.arange(24, 34)[None], cache, lean=lean)
        step = forward_last(model, ids[:, 34:35], torch.tensor([[34]]), cache, lean=lean)
        # a 4D mask in which the new tokens may not see the last 4 cached ones (an interleaved prompt)
        masked = _filled(model, 24, 64, ids)
        mask = torch.zeros(1, 1, 6, 30, dtype=dtype)
        mask[..., 20:24] = torch.finfo(dtype).min
        mask[..., 24:] = torch.triu(torch.full((6, 6), torch.finfo(dtype).min, dtype=dtype), 1)
        third = forward_last(model, ids[:, 24:30], torch.arange(24, 30)[None], masked, mask, lean=lean)
        if lean:
            ref = (got, step, third)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(ref, (got, step, third)):
        assert torch.allclose(a, b, atol=tol, rtol=0), f"{(a - b).abs().max()=}"


def _next_logits(model, ids: torch.Tensor, lean: bool) -> torch.Tensor:
    cache = _filled(model, 24, 64, ids)
    return forward_last(model, ids[:, 24:30], torch.arange(24, 30)[None], cache, lean=lean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_projections_with_biases_equal_the_modules(dtype, monkeypatch):
    if not can_pack(torch.empty(1, dtype=dtype)):
        pytest.skip(f"oneDNN's packed linear does not run {dtype} here")
    model = AutoModelForCausalLM.from_config(ARCHS["llama"](attention_bias=True), attn_implementation="sdpa")
    model = model.to(dtype).eval()
    with torch.no_grad():  # the tiny config's biases start at zero: give them values the test can see
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.v_proj, layer.self_attn.o_proj):
                proj.bias.normal_()
    ids = torch.randint(0, 128, (1, 40))
    monkeypatch.setenv(PACK_ENV, "0")
    assert not LeanLlama(model).packed
    monkeypatch.delenv(PACK_ENV)
    lean = lean_forward(model)
    lean.pack()  # where the native step runs the one-token steps, only when asked (test_packing_waits_...)
    assert lean.packed
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    packed, ref = _next_logits(model, ids, lean=True), _next_logits(model, ids, lean=False)
    assert torch.allclose(packed, ref, atol=tol, rtol=0), f"{(packed - ref).abs().max()=}"


def test_packed_weights_follow_a_changed_weight():
    model = _tiny("llama")
    ids = torch.randint(0, 128, (1, 40))
    before = _next_logits(model, ids, lean=True)
    with torch.no_grad():  # in place, as load_state_dict does: the packed copy must not go stale
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
        model.lm_head.weight.add_(0.5)
    after, ref = _next_logits(model, ids, lean=True), _next_logits(model, ids, lean=False)
    assert not torch.allclose(before, after, atol=1e-3)
    assert torch.allclose(after, ref, atol=1e-5, rtol=0), f"{(after - ref).abs().max()=}"
    model.to(torch.bfloat16)  # new tensors in another dtype: packed again, in bf16
    if can_pack(model.lm_head.weight):
        lean_forward(model).pack()
        logits = _next_logits(model, ids, lean=True)
        assert lean_forward(model).head.weight.dtype == torch.bfloat16
        assert torch.allclose(logits, _next_logits(model, ids, lean=False), atol=2e-2, rtol=0)


def test_packing_waits_to_be_asked_where_the_native_step_runs_the_one_token_steps():
    model = _tiny("llama").to(torch.bfloat16)
    if not can_pack(model.lm_head.weight):
        pytest.skip("oneDNN's packed linear does not run bf16 here")
    lean = LeanLlama(model)
    native_steps = lean.step.usable and native.library() is not None
    assert lean.packed is not native_steps  # packed on first use only where no native step runs them
    ids = torch.randint(0, 128, (1, 40))
    before = _next_logits(model, ids, lean=True)
    lean_forward(model).pack()
    assert lean_forward(model).packed
    assert torch.allclose(_next_logits(model, ids, lean=True), before, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_embedding_is_transformers_llamas_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as theirs

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 9, 16, generator=g).to(dtype), torch.randn(2, 2, 9, 16, generator=g).to(dtype)
    cos, sin = torch.randn(2, 9, 16, generator=g).to(dtype), torch.randn(2, 9, 16, generator=g).to(dtype)
    for mine, ref in zip(apply_rotary_pos_emb(q, k, cos, sin), theirs(q, k, cos, sin)):
        assert torch.equal(mine, ref)


def test_the_engine_imports_without_transformers_model_classes():
    """The engine's modules name transformers' model classes only for type checkers: a command that reads
    the engine's names without running a model (`info`) does not wait seconds for transformers' model code."""
    code = ("import sys\nimport rag_promptcache.engine.engine, rag_promptcache.engine.planning.recovery, "
            "rag_promptcache.engine.batching.batch, rag_promptcache.engine.compute.graphs\n"
            "from rag_promptcache.engine import PromptCache, Sampling\n"
            "print(sorted(m for m in sys.modules if m.startswith(('transformers.modeling_utils', 'transformers.models.'))"
            " and 'modeling' in m))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_other_architectures_keep_transformers_forward():
    assert lean_forward(_tiny("qwen2")) is None
    assert lean_forward(_tiny("gemma")) is None


def test_engine_assembly_runs_the_same_on_lean_and_transformers_forward(tokenizer):
    # relocated modules and a parameter value inside a module (a 4D mask): the engine's real inputs
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, recovery="none", fallback="never")
    assert lean_forward(pc.model) is not None
    pc.add_schema('<schema name="s"><module name="a">alpha beta gamma delta</module>'
                  '<module name="t">Plan a trip for <param name="d" len="4"/> around it.</module></schema>')
    plan = pc.plan('<prompt schema="s"><t d="three days"/><a/> zeta eta</prompt>')
    logits = []
    for lean in (True, False):
        asm = assemble(plan.pieces, plan.kvs, pc.relocator, pc.model.config, pc.geometry, pc.model.device,
                       pc.model.dtype, extra=4)
        assert asm.mask is not None
        logits.append(forward_last(pc.model, asm.new_ids, asm.new_positions, asm.cache, asm.mask, lean=lean))
    assert torch.allclose(*logits, atol=1e-5, rtol=0), f"{(logits[0] - logits[1]).abs().max()=}"


def test_reserved_buffers_return_to_the_pool_and_are_reused():
    model = _tiny("llama")
    g = kv_geometry(model)
    _POOL.clear()
    cache, keys, _ = reserved_cache(model.config, g, 100, model.dtype, model.device)
    assert keys.shape[2] == 256  # rounded up to CAPACITY_STEP
    ptr = keys.data_ptr()
    del cache, keys
    gc.collect()
    again, keys2, _ = reserved_cache(model.config, g, 200, model.dtype, model.device)
    assert keys2.data_ptr() == ptr  # reused while free
    other, keys3, _ = reserved_cache(model.config, g, 200, model.dtype, model.device)
    assert keys3.data_ptr() != ptr  # never handed to two live caches
    _POOL.clear()


def test_sdpa_output_in_cudas_memory_layout_is_read_as_it_is(tokenizer, monkeypatch):
    """CUDA's SDPA kernels return [B, H, N, D] over [B, N, H, D]-contiguous memory, which `.view` cannot
    regroup (the first GPU run found that): the lean forward takes SDPA's output in that layout, here
    made on the CPU, and answers the same, alone and batched."""
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def cuda_layout(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.transpose(-2, -3).contiguous().transpose(-2, -3)  # the same values, the other strides

    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, recovery="none", prefix_cache_bytes=0)
    prompt = "A plain prompt of a few words, long enough to need a mask."
    plain = pc.generate(prompt, max_new_tokens=4, ignore_eos=True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", cuda_layout)
    assert pc.generate(prompt, max_new_tokens=4, ignore_eos=True).token_ids == plain.token_ids
    assert [r.token_ids for r in pc.generate_batch([prompt, prompt + " Two."], max_new_tokens=4,
                                                   ignore_eos=True)][0] == plain.token_ids
