"""Where a cached key carries its position, per architecture, and how to move it.

A prompt module's keys are stored once, post-RoPE, as the model wrote them into its cache:
`keys: [layers, kv_heads, tokens, head_dim]` at positions `start .. start+tokens-1`. For RoPE,
R(p + d) = R(d) R(p), so rotating a stored key by the angle for `d` gives the key the model
would have written at `p + d`. Values never carry position.

`relocator_for(model)` returns one small object per architecture family:

- `RopeRelocator`: rotate_half or interleaved (GPT-J style) layout, partial rotary (only the
  first `2 * len(inv_freq)` dims turn), per-layer bases (Gemma-3 local/global), NoPE layers
  (Cohere-2 global layers, SmolLM3) left untouched. `inv_freq` is read from the model's own
  rotary module, so rope_theta and the linear / yarn / llama3 scalings are whatever the model
  uses. Their `attention_scaling` multiplies cos and sin in the model, so it is already inside
  the stored keys: the relocation is a pure rotation and never applies it again.
- `AbsoluteRelocator` (GPT-2, OPT, GPT-Neo): learned position embeddings are mixed into the
  hidden state; a module is valid only where it was encoded. `relocatable` is False and any
  non-zero delta raises.
- `NoPositionRelocator` (ALiBi: Bloom, MPT, Falcon with alibi): keys carry no position, rotate
  is the identity. These models derive distances from cache slot order, not position ids, so
  gaps in positions cannot be expressed; only the order of modules matters.

Exactness (checked against the model in tests/test_positions.py, fp32, error <= 1e-4):
- default, linear, yarn, llama3 RoPE, GPT-J/CodeGen, Cohere: exact for any delta, up to fp32
  rounding of angles: the model rounds p * inv_freq, we round delta * inv_freq, so the error grows
  with position like the model's own angle rounding does (a few 1e-5 on unit-size keys at p~500).
- dynamic NTK and longrope change inv_freq with the sequence length of the forward call. We
  rotate with the original (short) inv_freq, which is what the model uses while every position
  stays below `exact_below` (max_position_embeddings - 1 for dynamic, the rope parameters'
  original_max_position_embeddings for longrope). Past that bound the relocated keys would be
  wrong, and so would a cached prefix in general. `rotate` sees deltas, not absolute positions,
  so it cannot refuse by itself: callers check `exact_below` and recompute beyond it. (GPT-J and
  CodeGen set it to their sin/cos table length, past which the model itself cannot go.)
- Any other rope_type (and any model_type not in `SUPPORTED`) raises UnsupportedModelError.

Out of scope, refused with UnsupportedModelError: anything not in `SUPPORTED`, including MLA
caches (DeepSeek-V2/3), hybrid linear attention (Qwen3-Next, Jamba), M-RoPE (Qwen2-VL) and
Llama-4 chunked attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from rag_promptcache.model import native

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


class UnsupportedModelError(ValueError):
    """The model's position scheme is unknown here; relocating its keys could give wrong output."""


class Relocator(Protocol):
    kind: str  # "rope" | "absolute" | "alibi"
    relocatable: bool  # False: reuse keys only at the position they were encoded at
    exact_below: int | None  # rotate is exact while all positions are < this; None: everywhere

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor: ...

    def rotate_into(self, keys: torch.Tensor, shift: int, out: torch.Tensor) -> None:
        """Write `keys` [L, H, S, D] moved by `shift` positions into `out` (same shape, any dtype)."""
        ...


@dataclass(frozen=True, slots=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # per layer, as the model's DynamicCache sees them: "full_attention", ...
    sliding_window: int | None  # "sliding_attention" layers keep only the last sliding_window - 1 tokens


def kv_geometry(model: PreTrainedModel) -> KVGeometry:
    config = model.config.get_text_config()
    num_layers = config.num_hidden_layers
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    layer_types, _ = get_layer_types_and_kwargs(config)  # exactly what DynamicCache(config=...) builds
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if config.model_type == "falcon":  # the heads its attention caches: `num_kv_heads` (1 for multi-query), but
        # before transformers 5.25 the new decoder architecture's expanded to all heads (5.25 expands them in
        # attention, by `num_key_value_groups`)
        attention = next(m for m in model.modules() if hasattr(m, "new_decoder_architecture"))
        expanded = attention.new_decoder_architecture and not hasattr(attention, "num_key_value_groups")
        num_kv_heads = num_heads if expanded else attention.num_kv_heads
    return KVGeometry(num_layers, num_kv_heads, head_dim, tuple(layer_types), getattr(config, "sliding_window", None))


def _check(keys: torch.Tensor, deltas: torch.Tensor) -> None:
    assert keys.dim() == 4 and deltas.shape == (keys.shape[2],), f"{keys.shape=} {deltas.shape=}"


@dataclass(frozen=True, slots=True, eq=False)
class RopeRelocator:
    inv_freq: torch.Tensor  # [num_bases, rotary_dim / 2] float32; an all-zero row is NoPE (identity)
    layer_base: torch.Tensor  # [num_layers] int64: row of inv_freq each layer uses
    interleaved: bool = False  # pairs (2i, 2i+1) as GPT-J rotate_every_two; else (i, i + r/2), rotate_half
    exact_below: int | None = None
    kind: str = field(default="rope", init=False)
    relocatable: bool = field(default=True, init=False)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        # keys: [L, H, S, D] at positions p; deltas: [S] -> [L, H, S, D] at positions p + deltas
        _check(keys, deltas)
        assert keys.shape[0] == self.layer_base.shape[0], f"{keys.shape=} {self.layer_base.shape=}"
        d = deltas.to(device=keys.device, dtype=torch.float32)
        angle = d[None, :, None] * self.inv_freq.to(keys.device)[:, None, :]  # [bases, S, R/2]
        cos, sin = angle.cos(), angle.sin()
        if self.inv_freq.shape[0] > 1:  # Gemma-3 local/global, NoPE layers: pick each layer's row
            base = self.layer_base.to(keys.device)
            cos, sin = cos[base], sin[base]  # [L, S, R/2]
        cos, sin = cos[:, None], sin[:, None]  # [L or 1, 1, S, R/2] broadcasts over heads
        k = keys.to(torch.float32)
        r = 2 * self.inv_freq.shape[1]  # partial rotary: dims r.. pass through
        pairs = (slice(0, r, 2), slice(1, r, 2)) if self.interleaved else (slice(0, r // 2), slice(r // 2, r))
        x1, x2 = k[..., pairs[0]], k[..., pairs[1]]
        out = torch.empty_like(k)
        out[..., r:] = k[..., r:]
        o1, o2 = out[..., pairs[0]], out[..., pairs[1]]
        torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1)  # x1 cos - x2 sin
        torch.mul(x2, cos, out=o2).addcmul_(x1, sin)  # x2 cos + x1 sin
        return out.to(keys.dtype)

    def rotate_into(self, keys: torch.Tensor, shift: int, out: torch.Tensor) -> None:
        # one pass where the native kernel runs (bf16 on CPU, rotate_half): no fp32 copies of the keys
        if not shift:
            out.copy_(keys)
        elif not self._rotate_native(keys, shift, out):
            out.copy_(self.rotate(keys, torch.full((keys.shape[2],), shift, dtype=torch.long, device=keys.device)))

    def _rotate_native(self, keys: torch.Tensor, shift: int, out: torch.Tensor) -> bool:
        if self.interleaved or keys.device.type != "cpu" or not keys.dtype == out.dtype == torch.bfloat16:
            return False
        dim = keys.shape[-1]
        if keys.stride(-1) != 1 or out.stride(-1) != 1 or keys.stride(-2) != dim or out.stride(-2) != dim:
            return False
        lib = native.library()
        if lib is None:
            return False
        angle = torch.tensor([float(shift)], device=keys.device) * self.inv_freq  # [bases, R/2], as in `rotate`
        cos, sin = angle.cos()[self.layer_base].contiguous(), angle.sin()[self.layer_base].contiguous()  # [L, R/2]
        num_layers, heads, rows, _ = keys.shape
        rc = lib.rope_shift_bf16(keys.data_ptr(), out.data_ptr(), num_layers, heads, rows, dim, cos.shape[1],
                                 keys.stride(0), keys.stride(1), out.stride(0), out.stride(1), cos.data_ptr(),
                                 sin.data_ptr(), torch.get_num_threads())
        assert rc == 0, f"{rc=} {keys.shape=} {cos.shape=}"
        return True


def _rope_table(per_layer: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer inv_freq (None: NoPE) -> (distinct rows [bases, R/2], layer -> row [L])."""
    sizes = {f.shape[0] for f in per_layer if f is not None}
    assert len(sizes) == 1, f"{sizes=}"  # one rotary width per model
    (width,) = sizes
    device = next(f.device for f in per_layer if f is not None)  # the model's: no copy per rotate call
    rows: list[torch.Tensor] = []
    index: list[int] = []
    for f in per_layer:
        f = torch.zeros(width, device=device) if f is None else f.detach().to(torch.float32)
        hit = next((i for i, row in enumerate(rows) if torch.equal(row, f)), None)
        if hit is None:
            rows.append(f)
            hit = len(rows) - 1
        index.append(hit)
    return torch.stack(rows), torch.tensor(index, dtype=torch.int64, device=device)


@dataclass(frozen=True, slots=True)
class AbsoluteRelocator:
    kind: str = field(default="absolute", init=False)
    relocatable: bool = field(default=False, init=False)
    exact_below: int | None = field(default=None, init=False)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        _check(keys, deltas)
        if bool((deltas != 0).any()):
            raise ValueError("learned absolute positions: keys are valid only at their encoded position (delta 0)")
        return keys

    def rotate_into(self, keys: torch.Tensor, shift: int, out: torch.Tensor) -> None:
        out.copy_(self.rotate(keys, torch.full((keys.shape[2],), shift, dtype=torch.long)))


@dataclass(frozen=True, slots=True)
class NoPositionRelocator:
    kind: str = field(default="alibi", init=False)
    relocatable: bool = field(default=True, init=False)
    exact_below: int | None = field(default=None, init=False)

    def rotate(self, keys: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        _check(keys, deltas)
        return keys

    def rotate_into(self, keys: torch.Tensor, shift: int, out: torch.Tensor) -> None:
        out.copy_(keys)


_STATIC_ROPE = {"default", "linear", "yarn", "llama3"}
_LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


def _rotary_module(model: PreTrainedModel) -> torch.nn.Module:
    found = [m for name, m in model.named_modules() if name.endswith("rotary_emb")]
    if len(found) != 1:
        raise UnsupportedModelError(f"expected one shared rotary_emb module, found {len(found)}")
    return found[0]


def _rope(interleaved: bool = False, nope: Callable[[PretrainedConfig], set[int]] = lambda c: set()):
    def build(model: PreTrainedModel, config: PretrainedConfig) -> RopeRelocator:
        rot = _rotary_module(model)
        per_type = isinstance(rot.rope_type, dict)  # Gemma-3: one base per layer type
        skip = nope(config)
        per_layer: list[torch.Tensor | None] = []
        bounds: list[int] = []
        for i in range(config.num_hidden_layers):
            if i in skip:
                per_layer.append(None)
                continue
            layer_type = config.layer_types[i] if per_type else None
            rope_type = rot.rope_type[layer_type] if per_type else rot.rope_type
            params = config.rope_parameters[layer_type] if per_type else config.rope_parameters
            prefix = f"{layer_type}_" if per_type else ""
            if rope_type in _STATIC_ROPE:
                per_layer.append(getattr(rot, f"{prefix}inv_freq"))
            elif rope_type in _LENGTH_DEPENDENT_ROPE:
                per_layer.append(getattr(rot, f"{prefix}original_inv_freq"))  # the short-sequence frequencies
                longrope = rope_type == "longrope"
                bounds.append(params["original_max_position_embeddings"] if longrope else rot.original_max_seq_len - 1)
            else:
                valid = sorted(_STATIC_ROPE | _LENGTH_DEPENDENT_ROPE)
                raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported; supported: {valid}")
        inv_freq, layer_base = _rope_table(per_layer)
        return RopeRelocator(inv_freq, layer_base, interleaved, min(bounds) if bounds else None)

    return build


def _gptj(model: PreTrainedModel, config: PretrainedConfig) -> RopeRelocator:
    # GPT-J / CodeGen build a fixed sin/cos table with base 10000 in each attention layer
    # (create_sinusoidal_positions); this is the same float32 inv_freq it is built from.
    dim = config.rotary_dim or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    table, layer_base = _rope_table([inv_freq] * config.num_hidden_layers)
    return RopeRelocator(table, layer_base, True, config.max_position_embeddings)


def _non_sliding(config: PretrainedConfig) -> set[int]:
    return {i for i, t in enumerate(config.layer_types) if t != "sliding_attention"}


def _no_rope_layers(config: PretrainedConfig) -> set[int]:
    return {i for i, use_rope in enumerate(config.no_rope_layers) if not use_rope}


def _absolute(model: PreTrainedModel, config: PretrainedConfig) -> AbsoluteRelocator:
    return AbsoluteRelocator()


def _alibi(model: PreTrainedModel, config: PretrainedConfig) -> NoPositionRelocator:
    return NoPositionRelocator()


def _falcon(model: PreTrainedModel, config: PretrainedConfig) -> Relocator:
    return _alibi(model, config) if config.alibi else _rope()(model, config)


_rope_half = _rope()
# model_type -> builder. Add an architecture here and one line in tests/test_positions.py.
SUPPORTED: dict[str, Callable[[PreTrainedModel, PretrainedConfig], Relocator]] = {
    **dict.fromkeys(
        ["llama", "mistral", "mixtral", "qwen2", "qwen3", "phi", "phi3", "gemma", "gemma2", "gemma3_text",
         "gpt_neox", "stablelm", "granite", "olmo2", "starcoder2"],
        _rope_half,
    ),
    "smollm3": _rope(nope=_no_rope_layers),
    "cohere": _rope(interleaved=True),
    "cohere2": _rope(interleaved=True, nope=_non_sliding),
    "gptj": _gptj,
    "codegen": _gptj,
    "falcon": _falcon,
    "gpt2": _absolute,
    "opt": _absolute,
    "gpt_neo": _absolute,
    "bloom": _alibi,
    "mpt": _alibi,
}


def relocator_for(model: PreTrainedModel) -> Relocator:
    config = model.config.get_text_config()
    model_type = config.model_type
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {model_type!r} has no position relocator; supported: {sorted(SUPPORTED)}"
        )
    return SUPPORTED[model_type](model, config)
