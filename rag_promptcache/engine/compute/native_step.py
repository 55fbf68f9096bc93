"""The decode step in one native call (model/kernels/decode_step.c) for Llama models in bf16 on CPUs with AVX512-BF16.

A one-token step of a small model is dispatch-bound in torch: on SmolLM2-135M at a 16-token context
the lean forward's step took 22.6 ms, of which 14.8 ms were its 121 packed matrix-vector products and
the rest the ~50 other ops per layer, each a few microseconds of Python and dispatch (profiled on this
project's 2-core machine). The kernel runs the whole step, every layer and the head, as one call:
the products at the memory's speed, the elementwise work in the threads' own registers, the cache
written in place. The lean forward (engine/compute/forward.py) calls it for up to `MAX_NEW` new tokens with no
mask against its reserved cache: the plain decode step and a prompt lookup draft's check.

What it computes is the lean forward's, with transformers' bf16 roundings at the same places; sums
run in another order, so logits agree to rounding (tests/test_native_step.py).

`batch` runs the server's batched decode step the same way: one token for each of up to `MAX_NEW`
sequences, each against its own row of the batch cache at its own length, the weights read once for
all of them; what it writes and returns per row is what the single-sequence step does for that row.

Out of scope: masks (an assembly's prefill), a batch's prompt lookup checks or prefill chunks (the torch
forward runs those), fp32, fp16, CUDA, biases, Llama variants `LeanLlama.for_model` refuses.
"""

from __future__ import annotations

import weakref

import torch

from rag_promptcache.engine.kv.assemble import ReservedLayer
from rag_promptcache.model import native

MAX_NEW, MAX_DIM, MAX_GROUP = 16, 256, 16  # the C source's limits: new tokens, head_dim, query heads per KV head


class NativeStep:
    """The kernel's view of one model: its weights' addresses, refreshed with the lean forward's."""

    def __init__(self, model_layers, norm: torch.nn.Module, lm_head: torch.nn.Linear, config) -> None:
        self.layers = list(model_layers)
        self.norm_weight = norm.weight
        self.head_weight = lm_head.weight
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads or self.heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.inter = config.intermediate_size
        self.vocab = lm_head.out_features
        self.eps = float(config.rms_norm_eps)
        weights = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            weights.append([layer.input_layernorm.weight, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight,
                            a.o_proj.weight, layer.post_attention_layernorm.weight, m.gate_proj.weight,
                            m.up_proj.weight, m.down_proj.weight])
        self._weights = weights
        self.table = torch.tensor([[w.data_ptr() for w in row] for row in weights], dtype=torch.int64)
        self.usable = self._usable(lm_head)
        self._memo: tuple[list, list, tuple[torch.Tensor, torch.Tensor, int]] | None = None

    def _usable(self, lm_head: torch.nn.Linear) -> bool:
        tensors = [w for row in self._weights for w in row] + [self.norm_weight, self.head_weight]
        if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            return False
        if lm_head.bias is not None or any(lin.bias is not None for layer in self.layers
                                           for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                       layer.self_attn.v_proj, layer.self_attn.o_proj)):
            return False
        if self.heads % self.kv_heads or self.heads // self.kv_heads > MAX_GROUP:
            return False
        return self.head_dim % 2 == 0 and self.head_dim <= MAX_DIM and self.hidden % 2 == 0 and self.inter % 2 == 0

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers, keep: int) -> torch.Tensor | None:
        """x: the new tokens' embeddings [1, N, E] bf16; cos, sin [1, N, D] bf16; `layers` the reserved
        cache's, holding the cached tokens: the new ones' KV is written after them. → logits [keep, V]
        fp32, or None where the kernel does not apply (the caller runs the torch forward)."""
        lib = native.library()
        n = x.shape[1]
        if lib is None or not self.usable or n > MAX_NEW or x.shape[0] != 1 or x.dtype != torch.bfloat16:
            return None
        buffers = self._buffers(layers)
        length = layers[0].length
        if buffers is None or any(layer.length != length for layer in layers) or layers[0]._keys.shape[-2] < length + n:
            return None  # not our cache, or out of room: the torch forward grows it
        keys, values, stride = buffers
        x = x.contiguous()
        cos, sin = cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous()
        logits = torch.empty(keep, self.vocab, dtype=torch.float32)
        rc = lib.llama_decode_bf16(self.table.data_ptr(), self.norm_weight.data_ptr(), self.head_weight.data_ptr(),
                                   keys.data_ptr(), values.data_ptr(), stride, length, len(layers), self.hidden,
                                   self.heads, self.kv_heads, self.head_dim, self.inter, self.vocab, self.eps,
                                   x.data_ptr(), n, cos.data_ptr(), sin.data_ptr(), keep, logits.data_ptr(),
                                   torch.get_num_threads())
        if rc != 0:
            return None
        for layer in layers:
            layer.set_length(length + n)
        return logits

    def batch(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers, lengths: list[int]) -> torch.Tensor | None:
        """One token for each of B sequences of the server's batch cache (engine/batching/batch.py), one kernel call
        for all: x [B, 1, E] bf16; cos, sin [B, 1, D]; `layers` the batch cache's (`_keys`, `_values`
        [rows, H, capacity, D] per layer), row b holding lengths[b] tokens: the new KV is written after
        them (the caller counts it). → logits [B, V] fp32, or None where the kernel does not apply."""
        lib = native.library()
        b = x.shape[0]
        if (lib is None or not self.usable or b > MAX_NEW or x.shape[1] != 1 or x.dtype != torch.bfloat16
                or len(lengths) != b):
            return None
        first = layers[0]._keys
        stride, capacity = first.stride(1), first.shape[-2]
        if max(lengths) + 1 > capacity:
            return None
        for layer in layers:
            for t in (layer._keys, layer._values):
                if (t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.shape[-2] != capacity
                        or t.stride(1) != stride or t.stride(2) != self.head_dim or t.stride(3) != 1):
                    return None
        # [layers, B] addresses: row r of each layer's buffers
        keys = torch.tensor([[layer._keys[r].data_ptr() for r in range(b)] for layer in layers], dtype=torch.int64)
        values = torch.tensor([[layer._values[r].data_ptr() for r in range(b)] for layer in layers], dtype=torch.int64)
        rows = torch.tensor(lengths, dtype=torch.int64)
        x = x.contiguous()
        cos, sin = cos.to(torch.bfloat16).contiguous(), sin.to(torch.bfloat16).contiguous()
        logits = torch.empty(b, self.vocab, dtype=torch.float32)
        rc = lib.llama_decode_batch_bf16(self.table.data_ptr(), self.norm_weight.data_ptr(), self.head_weight.data_ptr(),
                                         keys.data_ptr(), values.data_ptr(), stride, rows.data_ptr(), len(layers),
                                         self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, self.vocab,
                                         self.eps, x.data_ptr(), b, cos.data_ptr(), sin.data_ptr(), logits.data_ptr(),
                                         torch.get_num_threads())
        return logits if rc == 0 else None

    def _buffers(self, layers) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The addresses of the cache's key and value buffers, one per layer, and their KV-head stride;
        None where the kernel cannot read them. Kept for the next step while the same buffers serve the
        same layers (weakly: a cache that ends is not kept alive), ~200 us otherwise."""
        memo = self._memo
        if (memo is not None and len(memo[0]) == len(layers)
                and all(ref() is layer and kref() is layer._keys for ref, kref, layer in zip(memo[0], memo[1], layers))):
            return memo[2]
        first = layers[0]
        if type(first) is not ReservedLayer:
            return None
        stride, capacity = first._keys.stride(1), first._keys.shape[-2]
        for layer in layers:
            if (type(layer) is not ReservedLayer or layer._keys.dtype != torch.bfloat16
                    or layer._keys.shape[-2] != capacity or layer._values.shape[-2] != capacity
                    or layer._keys.stride(1) != stride or layer._values.stride(1) != stride
                    or layer._keys.stride(2) != self.head_dim or layer._values.stride(2) != self.head_dim):
                return None
        keys = torch.tensor([layer._keys.data_ptr() for layer in layers], dtype=torch.int64)
        values = torch.tensor([layer._values.data_ptr() for layer in layers], dtype=torch.int64)
        self._memo = ([weakref.ref(layer) for layer in layers], [weakref.ref(layer._keys) for layer in layers],
                      (keys, values, stride))
        return keys, values, stride
