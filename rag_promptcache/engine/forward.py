"""A lean forward pass for Llama-family models over the engine's reserved KV cache, gpt-fast style.

transformers' forward does per call what our caches make unnecessary: it builds a 4D causal mask
(`create_causal_mask`), walks generic cache and attention-interface dispatch per layer, and, for a
masked prefill against a cache, repeats the KV heads (a copy of the whole cache in every layer). Here
the layers' own weights run in one flat loop: the query heads that share a KV head are folded into
the query-length axis (`[B, Hkv, group * N, D]`), so SDPA reads the cache in place without repeating
it and without the GQA path, and the mask (when one is needed) is built once per call, not per layer.

Exactness: the same modules' weights, the same RMSNorm, rotary embedding and SDPA math as
transformers' Llama; outputs match it to float rounding (tests/test_forward.py compares logits).

Out of scope: other architectures (they keep transformers' forward: `LeanLlama.for_model` returns
None), caches that are not `ReservedLayer` buffers (sliding windows), batches (the server's batched
step lives in engine/batch.py), training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rag_promptcache.engine.assemble import ReservedLayer

_SUPPORTED = frozenset({"LlamaForCausalLM"})  # SmolLM2, Llama 2/3, TinyLlama, ...


class LeanLlama:
    """The forward of one Llama model, reading its modules' weights (never copying them)."""

    def __init__(self, model: PreTrainedModel) -> None:
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = self.num_heads // self.num_kv_heads
        self.scale = self.head_dim**-0.5
        inner = model.model
        self.embed, self.rotary, self.norm, self.lm_head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = list(inner.layers[: cfg.num_hidden_layers])

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
                 mask: torch.Tensor | None) -> torch.Tensor:
        """ids, positions: [1, N]; mask: [1, 1, N, C + N] additive or None (causal); → logits [V] fp32."""
        layers = cache.layers
        assert all(type(layer) is ReservedLayer for layer in layers), "lean forward needs a reserved cache"
        n = ids.shape[1]
        num_cached = layers[0].length
        x = self.embed(ids)  # [1, N, E]
        cos, sin = self.rotary(x, positions)
        attn_mask = self._mask(mask, n, num_cached, x.dtype, x.device)
        for layer, kv in zip(self.layers, layers):
            x = x + self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin, kv, attn_mask, n)
            mlp = layer.mlp
            h = layer.post_attention_layernorm(x)
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
        return self.lm_head(self.norm(x[:, -1:]))[0, -1].float()

    def _attention(self, attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: ReservedLayer,
                   mask: torch.Tensor | None, n: int) -> torch.Tensor:
        d, hkv = self.head_dim, self.num_kv_heads
        q = attn.q_proj(h).view(1, n, self.num_heads, d).transpose(1, 2)  # [1, Hq, N, D]
        k = attn.k_proj(h).view(1, n, hkv, d).transpose(1, 2)  # [1, Hkv, N, D]
        v = attn.v_proj(h).view(1, n, hkv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = kv.update(k, v)  # [1, Hkv, C + N, D], views of the reserved buffers
        # q heads h*g .. h*g+g-1 share KV head h (transformers' repeat_kv order): fold them into rows
        q = q.reshape(1, hkv, self.group * n, d)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        out = out.view(1, self.num_heads, n, d).transpose(1, 2).reshape(1, n, self.num_heads * d)
        return attn.o_proj(out)

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
