"""Fused attention for a prefill against a cache on CPUs with AVX512-BF16 (model/kernels/prefill_attention.c).

What is left of a cached prompt's time to first token is the forward over the question's tokens
against the assembled cache, and half of it was attention. For 41 new tokens against 2k cached ones
SDPA's CPU flash kernel ran at about 116 GFLOP/s on this project's 2-core machine, a third of what
the same CPU's bf16 matmul reaches. Plain bf16 matmuls would be faster but round every score to bf16
(0.08 off at a score of 20). This kernel keeps SDPA's arithmetic instead: scores accumulated in fp32
by the CPU's bf16 dot-product instruction and never rounded, an online fp32 softmax, probabilities
rounded to bf16 for the product with V. Its error against an fp64 reference is SDPA's
(tests/test_attention.py). Building and loading: model/native.py.

`prefill_attention` returns None wherever the kernel does not apply, and the caller runs SDPA:
another device or dtype, no native kernels here (model/native.py), a layout it does not read.

Out of scope: masks other than "every cached key, then causal among the new tokens" (parameters
inside modules, recovered tokens before cached ones: SDPA with the mask), fp32 and fp16, CUDA, and
batches of more than one sequence.
"""

from __future__ import annotations

import torch

from rag_promptcache.model import native

MAX_DIM = 256  # the kernel's limit on head_dim (MAX_DIM in the C source)


def available() -> bool:
    """Whether `prefill_attention` can run here at all (it may still decline a call)."""
    return native.library() is not None


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_new: int,
                      scale: float) -> torch.Tensor | None:
    """softmax(q keysᵀ · scale + mask) values, where every query row sees all keys but the last
    `num_new` and, of those, the new tokens up to its own (row r is new token r % num_new).

    q: [1, Hkv, R, D] (query heads folded into rows); keys, values: [1, Hkv, C, D] with contiguous
    rows (the reserved cache's views) → [1, Hkv, R, D], or None where the kernel does not apply."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or q.shape[0] != 1 or q.shape[-1] > MAX_DIM:
        return None
    if keys.dtype != q.dtype or values.dtype != q.dtype or keys.stride(-1) != 1 or values.stride(-1) != 1:
        return None
    if keys.stride(-2) != q.shape[-1] or values.stride(-2) != q.shape[-1] or q.shape[-1] % 2:
        return None
    lib = native.library()
    if lib is None:
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    _, heads, rows, dim = q.shape
    rc = lib.prefill_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), heads, rows,
                               dim, keys.shape[-2], num_new, keys.stride(1), values.stride(1), scale,
                               torch.get_num_threads())
    assert rc == 0, f"{rc=} {q.shape=} {keys.shape=} {num_new=}"
    return out
