"""Fused attention for a prefill against a cache on CPUs with AVX512-BF16 (model/kernels/prefill_attention.c).

What is left of a cached prompt's time to first token is the forward over the question's tokens
against the assembled cache, and half of it was attention. For 41 new tokens against 2k cached ones
SDPA's CPU flash kernel ran at about 116 GFLOP/s on this project's 2-core machine, a third of what
the same CPU's bf16 matmul reaches. Plain bf16 matmuls would be faster but round every score to bf16
(0.08 off at a score of 20). This kernel keeps SDPA's arithmetic instead: scores accumulated in fp32
by the CPU's bf16 dot-product instruction and never rounded, an online fp32 softmax, probabilities
rounded to bf16 for the product with V. Its error against an fp64 reference is SDPA's
(tests/test_attention.py). Building and loading: model/native.py.

The masks it applies are those assembly builds: each new token sees a prefix of the cache (all of
it, or, where cached text follows it in the prompt, what comes before it) and the new tokens up to
itself; `visible_prefixes` reads a mask into that form. `prefill_attention` returns None wherever
the kernel does not apply, and the caller runs SDPA: another device or dtype, no native kernels
here (model/native.py), a layout it does not read.

Out of scope: other masks (SDPA runs them), fp32 and fp16, CUDA, batches of more than one sequence.
"""

from __future__ import annotations

import torch

from rag_promptcache.model import native

MAX_DIM = 256  # the kernel's limit on head_dim (MAX_DIM in the C source)


def available(dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu") -> bool:
    """Whether `prefill_attention` runs for tensors of this dtype and device here (it may still
    decline a call whose layout it does not read)."""
    return torch.device(device).type == "cpu" and dtype == torch.bfloat16 and native.library() is not None


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_new: int, scale: float,
                      visible: torch.Tensor | None = None) -> torch.Tensor | None:
    """softmax(q keysᵀ · scale + mask) values, where the last `num_new` keys are the new tokens' (row r
    is new token r % num_new): new token i sees the first `visible[i]` cached keys (all of them where
    `visible` is None) and the new tokens up to itself.

    q: [1, Hkv, R, D] (query heads folded into rows); keys, values: [1, Hkv, C, D] with contiguous
    rows (the reserved cache's views); visible: [num_new] int32 → [1, Hkv, R, D], or None where the
    kernel does not apply."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or q.shape[0] != 1 or q.shape[-1] > MAX_DIM:
        return None
    if keys.dtype != q.dtype or values.dtype != q.dtype or keys.stride(-1) != 1 or values.stride(-1) != 1:
        return None
    if keys.stride(-2) != q.shape[-1] or values.stride(-2) != q.shape[-1] or q.shape[-1] % 2:
        return None
    lib = native.library()
    if lib is None:
        return None
    if visible is not None:
        visible = visible.to(device="cpu", dtype=torch.int32).contiguous()
        assert visible.shape == (num_new,), f"{visible.shape=} {num_new=}"
    q = q.contiguous()
    out = torch.empty_like(q)
    _, heads, rows, dim = q.shape
    rc = lib.prefill_attention(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(),
                               None if visible is None else visible.data_ptr(), heads, rows, dim,
                               keys.shape[-2], num_new, keys.stride(1), values.stride(1), scale,
                               torch.get_num_threads())
    assert rc == 0, f"{rc=} {q.shape=} {keys.shape=} {num_new=}"
    return out


def visible_prefixes(mask: torch.Tensor, num_cached: int) -> torch.Tensor | None:
    """mask: additive [1, 1, N, C + N] → per new token the number of cached keys it sees, [N] int32,
    where the mask is exactly "a prefix of the cache, then causal among the new tokens" (every mask
    assembly builds: the cache holds its tokens in sequence order); else None."""
    n = mask.shape[-2]
    seen = mask[0, 0] == 0  # [N, C + N]
    cached, new = seen[:, :num_cached], seen[:, num_cached:]
    counts = cached.sum(-1, dtype=torch.int32)
    prefix = torch.arange(num_cached, device=mask.device)[None, :] < counts[:, None]
    causal = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    return counts if torch.equal(cached, prefix) and torch.equal(new, causal) else None
