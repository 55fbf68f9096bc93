"""Which forward runs: the one place that picks between the lean forward (engine/compute/forward.py) and
transformers' own, and that sets transformers' GQA switch around the passes that need it.

Every forward pass of the engine goes through here: the prefill and each decode step
(`forward_logits`), the batched decode step (`forward_batch`), and the passes that run the model's
own layers to read KV or hidden states (`forward_base`: module encoding, recovery's probes).

Out of scope: what runs when (engine/decoding/decode.py, engine/batching/batcher.py), the caches (engine/kv/assemble.py,
engine/batching/batch.py), sampling (engine/decoding/sampling.py).
"""

from __future__ import annotations

import functools
import inspect

import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from rag_promptcache.engine.kv.assemble import Mask, ReservedLayer
from rag_promptcache.engine.compute.forward import LeanLlama

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


class _Switch:
    """The environment switch is process-global: count the forward passes that need it, so that one
    thread leaving never unsets it under another thread's forward (of this engine or another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._set_outside = False  # the user set it: never unset it

    def enter(self) -> None:
        with self._lock:
            if self._users == 0:
                self._set_outside = os.environ.get(_FORCE_GQA) is not None
                if not self._set_outside:
                    os.environ[_FORCE_GQA] = "1"
            self._users += 1

    def exit(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and not self._set_outside:
                os.environ.pop(_FORCE_GQA, None)


_GQA = _Switch()


@contextmanager
def native_gqa(device: torch.device) -> Iterator[None]:
    """On CPU, let SDPA do grouped-query attention itself, masks included.

    For a masked prefill (new tokens against a cache: q < kv) transformers otherwise repeats the KV
    heads, copying the whole cache in every layer: at 2k context on SmolLM2 that was a third of the
    time to first token. transformers reads this switch on every call; we set it only around our own
    forward passes and only on CPU (on CUDA a mask with GQA would fall back to the slow math kernel).
    """
    if device.type != "cpu":
        yield
        return
    _GQA.enter()
    try:
        yield
    finally:
        _GQA.exit()


_LEAN: weakref.WeakKeyDictionary[PreTrainedModel, LeanLlama | None] = weakref.WeakKeyDictionary()


def lean_forward(model: PreTrainedModel) -> LeanLlama | None:
    """The model's lean forward (engine/compute/forward.py), built once per model; None where it has none."""
    if model not in _LEAN:
        _LEAN[model] = LeanLlama.for_model(model)
    return _LEAN[model]


@torch.inference_mode()  # per call: a stream may resume on another thread, and the mode is thread-local
def forward_logits(
    model: PreTrainedModel,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    mask: Mask | None = None,
    *,
    keep: int = 1,
    lean: bool = True,
) -> torch.Tensor:
    """Run `ids` [1, N] at `positions` [1, N] against `cache`; return the last `keep` tokens' logits [keep, V] in fp32.

    `lean`: use the lean forward where the model and cache allow it (`lean=False`: transformers'). A mask
    per layer type (a model with sliding-window layers) is for transformers' forward, which takes it so."""
    fast = lean_forward(model) if lean else None
    if fast is not None and not isinstance(mask, dict) and all(type(layer) is ReservedLayer for layer in cache.layers):
        return fast(ids, positions, cache, mask, keep=keep)
    with native_gqa(ids.device):
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=keep,
                    **cache_arg(model, cache))
    return out.logits[0, -keep:].float()


@functools.cache
def _cache_keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def cache_arg(model: torch.nn.Module, cache: DynamicCache | None) -> dict[str, DynamicCache | None]:
    """The cache as the keyword `model`'s forward takes it: `cache` where transformers renamed it (newer
    5.x, which warns on `past_key_values`), `past_key_values` before that and in models not renamed."""
    return {_cache_keyword(type(model)): cache}


def output_cache(out: Mapping[str, object]) -> DynamicCache | None:
    """The cache a transformers forward returned, by the name its output carries: `cache` where transformers
    renamed it (newer 5.x, whose `past_key_values` property warns), `past_key_values` before that."""
    return out["cache"] if "cache" in out else out.get("past_key_values")  # type: ignore[return-value]


def forward_last(model: PreTrainedModel, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                 mask: Mask | None = None, *, lean: bool = True) -> torch.Tensor:
    """`forward_logits` of the last token only → logits [V] fp32."""
    return forward_logits(model, ids, positions, cache, mask, lean=lean)[-1]


@torch.inference_mode()
def forward_batch(model: PreTrainedModel, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                  mask: torch.Tensor, *, lean: bool = True) -> torch.Tensor:
    """One token per row of the batch cache (engine/batching/batch.py). ids, positions: [B, 1]; mask: [B, 1, 1, span]
    additive → logits [B, V] fp32. `lean`: `LeanLlama.decode_batch` where the model has one; False: transformers'."""
    fast = lean_forward(model) if lean else None
    if fast is not None:
        return fast.decode_batch(ids, positions, cache.layers, mask)
    with native_gqa(ids.device):
        out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True, logits_to_keep=1,
                    **cache_arg(model, cache))
    return out.logits[:, -1].float()


def forward_base(model: PreTrainedModel, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                 mask: Mask | None = None) -> None:
    """The model's own decoder layers, no head: `cache` fills with the KV of `ids` [B, N] at `positions`.
    Always transformers' forward: its callers read KV per row or hook its layers (engine/planning/encoder.py,
    engine/planning/recovery.py), which the lean forward does not offer."""
    with native_gqa(ids.device):  # a masked prefill against a cache (a shared prefix, an assembly)
        model.base_model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         **cache_arg(model.base_model, cache))


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList | None:
    """The model's decoder layers as transformers runs them (`forward_base`); None where not found."""
    base = model.base_model
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    return None
