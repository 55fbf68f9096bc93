"""A lean forward pass for Llama-family models over the engine's reserved KV cache, gpt-fast style.

transformers' forward does per call what our caches make unnecessary: it builds a 4D causal mask
(`create_causal_mask`), walks generic cache and attention-interface dispatch per layer, and, for a
masked prefill against a cache, repeats the KV heads (a copy of the whole cache in every layer). Here
the layers' own weights run in one flat loop: the query heads that share a KV head are folded into
the query-length axis (`[B, Hkv, group * N, D]`), so SDPA reads the cache in place without repeating
it and without the GQA path, and the mask (when one is needed) is built once per call, not per layer.
In bf16 on a CPU with AVX512-BF16, a prefill against the cache (the question and what recovery
recomputes, a prompt lookup check) skips SDPA and the additive mask: a fused kernel computes the same
attention from how much of the cache each new token sees (engine/compute/attention.py; 24 against 60 ms over
SmolLM2's 30 layers for the question at 2k context, timed in place once on this project's 2-core machine).

On CPU the linear maps run on a copy of their weights in oneDNN's packed layout (`Projection`), the
projections that read the same input fused into one: q, k and v; gate and up. A one-token step is a
matrix-vector product per weight, bound by how fast the weights stream from memory, and there the
packed kernel reads them about twice as fast as `F.linear` (21 against 10 GB/s in bf16, 23 against
12 GB/s in fp32, on this project's 2-core machine). The cost is that copy: the model's linear weights
once more in memory (270 MB for SmolLM2-135M in bf16), made on first use and again whenever a weight
changes (`refresh`). Where the native step runs the one-token steps (below), the copy only speeds up a
prefill of tens to hundreds of tokens, by about 5%, for 0.2-0.45 s of packing: it is made when asked
(`pack`: a process that answers many questions, `PromptCache.ready_to_answer`), not on first use, so
that a one-answer process (`ask`) does not pay for it. `RAG_PROMPTCACHE_PACK=0` turns it off.

Exactness: the same modules' weights, the same RMSNorm, rotary embedding and SDPA math as
transformers' Llama; outputs match it to float rounding (tests/test_forward.py compares logits).

Where the native kernels run (bf16, AVX512-BF16), an unmasked step of up to 16 tokens (a decode step,
a prompt lookup check) skips all of the above: engine/compute/native_step.py runs every layer and the head
in one call, and these layers run only where it declines.

Also the server's batched decode step (`decode_batch`, over engine/batching/batch.py's cache: one token per row):
the native kernel's batch call where it runs, these layers where it declines.

Out of scope: other architectures (they keep transformers' forward: `LeanLlama.for_model` returns
None), caches that are not `ReservedLayer` buffers (chunked or linear attention), batched prefill, training.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rag_promptcache.engine.compute import attention
from rag_promptcache.model.rotary import apply_rotary_pos_emb
from rag_promptcache.engine.kv.assemble import ReservedLayer
from rag_promptcache.engine.compute.attention import prefill_attention
from rag_promptcache.engine.compute.native_step import NativeStep
from rag_promptcache.model import native
from rag_promptcache.model.loading import onednn_bf16

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_SUPPORTED = frozenset({"LlamaForCausalLM"})  # SmolLM2, Llama 2/3, TinyLlama, ...
# where the fused attention kernel runs: (cached keys each new token sees or None for all, the caller's mask)
Fused = tuple[torch.Tensor | None, torch.Tensor | None]
PACK_ENV = "RAG_PROMPTCACHE_PACK"  # "0": the lean forward calls the model's own linear modules


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed linear kernel runs on this weight's device and dtype here."""
    if os.environ.get(PACK_ENV, "1").strip().lower() in ("0", "false", "off"):
        return False
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16:
        return onednn_bf16()
    return weight.dtype == torch.float32


class Projection:
    """Linear maps of the same input, fused along the output axis: `proj(x)` → one output per map.

    Packed (`can_pack`): one call on a copy of the weights in oneDNN's blocked layout, made for a
    batch of one row (the decode step; a prefill of thousands of rows runs as fast as `F.linear` on
    it). Otherwise the modules themselves, one call each."""

    def __init__(self, linears: Sequence[torch.nn.Linear], pack: bool) -> None:
        self.linears = tuple(linears)
        self.sizes = [lin.out_features for lin in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        if pack:
            weight = torch.cat([lin.weight.detach() for lin in linears])
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            if any(lin.bias is not None for lin in linears):
                self.bias = torch.cat([lin.weight.new_zeros(lin.out_features) if lin.bias is None
                                       else lin.bias.detach() for lin in linears])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(lin(x) for lin in self.linears)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), self.weight, self.bias, "none", [], "")
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y.split(self.sizes, dim=-1) if len(self.sizes) > 1 else (y,)


class LeanLlama:
    """The forward of one Llama model over its modules' weights (on CPU, a packed copy of the linear ones)."""

    def __init__(self, model: PreTrainedModel) -> None:
        """Holds the model's modules, not the model: the engine's per-model cache of these is weak."""
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        inner = model.model
        self.config = cfg
        self.embed, self.rotary, self.norm, self.lm_head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = list(inner.layers[: cfg.num_hidden_layers])
        linears = [self.lm_head]
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            linears += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
        self._weights = [lin.weight for lin in linears]  # module attribute lookups cost 4 us each
        self._signature: list[tuple[int, int]] = []
        self._asked_to_pack = False
        self.refresh()

    def pack(self) -> None:
        """Pack the linear weights now where oneDNN runs them (`can_pack`), also where the native step runs
        the one-token steps and they would not be packed on first use."""
        if not self._asked_to_pack:
            self._asked_to_pack = True
            self._signature = []
            self.refresh()

    def refresh(self) -> None:
        """Build the projections again if a weight changed since, in place or by `.to()`: ~60 us otherwise.
        (A weight replaced by another Parameter object, `load_state_dict(assign=True)`, is not seen.)"""
        signature = [(w.data_ptr(), w._version) for w in self._weights]
        if signature == self._signature:
            return
        self.step = NativeStep(self.layers, self.norm, self.lm_head, self.config)
        native_steps = self.step.usable and native.library() is not None
        pack = can_pack(self.lm_head.weight) and (self._asked_to_pack or not native_steps)
        self.qkv, self.o, self.gate_up, self.down = [], [], [], []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            self.qkv.append(Projection((a.q_proj, a.k_proj, a.v_proj), pack))
            self.o.append(Projection((a.o_proj,), pack))
            self.gate_up.append(Projection((m.gate_proj, m.up_proj), pack))
            self.down.append(Projection((m.down_proj,), pack))
        self.head = Projection((self.lm_head,), pack)
        self.packed = pack
        self._signature = signature

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> LeanLlama | None:
        """None where this forward would not be exactly the model's own."""
        cfg = model.config
        if type(model).__name__ not in _SUPPORTED or getattr(cfg, "pretraining_tp", 1) != 1:
            return None
        if cfg.hidden_act != "silu" or getattr(cfg, "mlp_bias", False):
            return None
        if cfg.rope_parameters.get("rope_type", "default") in ("dynamic", "longrope"):
            return None  # the rotary module's state would depend on the sequence length seen
        return cls(model)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                 mask: torch.Tensor | None, keep: int = 1) -> torch.Tensor:
        """ids, positions: [1, N]; mask: [1, 1, N, C + N] additive or None (causal); → the last `keep`
        tokens' logits [keep, V] fp32."""
        layers = cache.layers
        assert all(type(layer) is ReservedLayer for layer in layers), "lean forward needs a reserved cache"
        self.refresh()
        n = ids.shape[1]
        num_cached = layers[0].length
        x = self.embed(ids)  # [1, N, E]
        cos, sin = self.rotary(x, positions)
        if mask is None:
            logits = self.step(x, cos, sin, layers, keep)
            if logits is not None:
                return logits
        # the fused kernel reads the mask as how much of the cache each new token sees (None: all of it);
        # SDPA gets the additive mask, built only if the kernel cannot run or declines
        fused = n > 1 and attention.available(x.dtype, x.device)
        visible = None
        if fused and mask is not None:
            visible = attention.visible_prefixes(mask, num_cached)
            fused = visible is not None
        # a plain prefill with nothing cached on CUDA: SDPA's own causal mask (flash attention), not a
        # [group * N, N] mask in memory (8 GiB at 32k tokens on an 8B model)
        causal = mask is None and num_cached == 0 and n > 1 and x.device.type == "cuda"
        attn_mask = None if fused or causal else self._mask(mask, n, num_cached, x.dtype, x.device)
        for i, (layer, kv) in enumerate(zip(self.layers, layers)):
            x = self._layer(i, layer, x, cos, sin, kv, attn_mask, (visible, mask) if fused else None, causal)
        return self.head(self.norm(x[:, -keep:]))[0][0].float()

    def decode_batch(self, ids: torch.Tensor, positions: torch.Tensor, layers: Sequence[DynamicLayer],
                     mask: torch.Tensor) -> torch.Tensor:
        """One token per row of the server's batch cache (engine/batching/batch.py: `BatchLayer.update` writes
        each row at its own length). ids, positions: [B, 1]; mask: [B, 1, 1, span] additive → logits [B, V] fp32."""
        self.refresh()
        x = self.embed(ids)  # [B, 1, E]
        cos, sin = self.rotary(x, positions)
        step = layers[0].step  # the batch's rows and their lengths before this token (engine/batching/batch.py)
        logits = self.step.batch(x, cos, sin, layers, step.lengths.tolist())
        if logits is not None:
            return logits
        for i, (layer, kv) in enumerate(zip(self.layers, layers)):
            x = self._layer(i, layer, x, cos, sin, kv, mask)  # the mask broadcasts over each row's folded heads
        return self.head(self.norm(x))[0][:, -1].float()

    def _layer(self, i: int, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: DynamicLayer,
               mask: torch.Tensor | None, fused: Fused | None = None, causal: bool = False) -> torch.Tensor:
        x = x + self._attention(i, layer.input_layernorm(x), cos, sin, kv, mask, fused, causal)
        return x + self.mlp(i, layer, x)

    def mlp(self, i: int, layer, x: torch.Tensor) -> torch.Tensor:
        """Layer i's feed-forward block on the residual stream `x` (its output, before the residual add)."""
        gate, up = self.gate_up[i](layer.post_attention_layernorm(x))
        return self.down[i](F.silu(gate) * up)[0]

    def _attention(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: DynamicLayer,
                   mask: torch.Tensor | None, fused: Fused | None = None, causal: bool = False) -> torch.Tensor:
        """`fused`: where the fused kernel may run, (cached keys each new token sees or None for all, the
        caller's mask) and `mask` is None; `causal`: nothing cached, SDPA's causal mask over the KV heads
        repeated; else SDPA with `mask`."""
        b, n = h.shape[:2]
        d, hkv = self.head_dim, self.num_kv_heads
        q, k, v = self.qkv[i](h)
        q = q.view(b, n, self.num_heads, d).transpose(1, 2)  # [B, Hq, N, D]
        k = k.view(b, n, hkv, d).transpose(1, 2)  # [B, Hkv, N, D]
        v = v.view(b, n, hkv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = kv.update(k, v)  # [B, Hkv, C + N, D], views of the cache's buffers
        if causal:  # transformers' repeat_kv order: q head h*g+j reads KV head h
            out = F.scaled_dot_product_attention(q, keys.repeat_interleave(self.group, dim=1),
                                                 values.repeat_interleave(self.group, dim=1), is_causal=True,
                                                 scale=self.scale)
            return self.o[i](out.transpose(1, 2).reshape(b, n, self.num_heads * d))[0]
        # q heads h*g .. h*g+g-1 share KV head h (transformers' repeat_kv order): fold them into rows
        q = q.reshape(b, hkv, self.group * n, d)
        out = prefill_attention(q, keys, values, n, self.scale, fused[0]) if fused else None
        if out is None:
            if fused:  # the kernel declined this call (layout): the mask it would have applied
                mask = self._mask(fused[1], n, keys.shape[-2] - n, q.dtype, q.device)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        # reshape, not view: CUDA's SDPA kernels return [B, N, H, D]-contiguous memory
        out = out.reshape(b, self.num_heads, n, d).transpose(1, 2).reshape(b, n, self.num_heads * d)
        return self.o[i](out)[0]

    def _mask(self, mask: torch.Tensor | None, n: int, num_cached: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor | None:
        """The additive mask per folded query row [1, 1, group * N, C + N]; None for one token."""
        if mask is None:
            if n == 1:
                return None  # one new token sees the whole cache
            row = torch.arange(n, device=device)[:, None]
            col = torch.arange(num_cached + n, device=device)[None, :]
            mask = torch.zeros(n, num_cached + n, dtype=dtype, device=device)
            mask.masked_fill_(col > num_cached + row, torch.finfo(dtype).min)
            mask = mask[None, None]
        assert mask.shape[-2:] == (n, num_cached + n), f"{mask.shape=} {n=} {num_cached=}"
        return mask.to(dtype).repeat(1, 1, self.group, 1)
