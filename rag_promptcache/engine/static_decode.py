"""The one-token decode step with static shapes, compiled with `torch.compile` (gpt-fast's `decode_one_token`).

The eager lean step (engine/forward.py) reads the reserved cache up to its current length: a shape
that changes every token, which a compiled graph would have to re-specialise for. Here the step
attends over the buffer's whole capacity with a mask that hides the slots not written yet, and the
position and the slot to write arrive as tensors: one graph serves every step of a request.

Graphs: one per cache capacity. Capacities are rounded up to `bucket()` values (256 x 1, 2, 3, 4, 6,
8, 12, ...: two per doubling) so that requests of any length share a few graphs; the engine reserves
exactly a bucket when compiling is on. A capacity that is not a bucket (a buffer grown past its
reservation, or one the pool kept from an eager request) runs the eager step rather than compiling.

Out of scope: sampling (it stays outside the graph: its options change per request), batches (the
server's batched step, engine/batch.py), architectures without a lean forward, CUDA graphs.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rag_promptcache.engine.assemble import CAPACITY_STEP, ReservedLayer
from rag_promptcache.engine.decode import lean_forward
from rag_promptcache.engine.forward import LeanLlama
from rag_promptcache.model.positions import kv_geometry

log = logging.getLogger(__name__)

ENV = "RAG_PROMPTCACHE_COMPILE"  # "1": compile the decode step (PromptCache(compile=None) reads it)
# mode → torch.compile keyword arguments. "freezing": weights become constants that inductor may
# pre-pack (oneDNN on CPU); it needs them never to change after the first call.
MODES: dict[str, dict[str, object]] = {
    "default": {},
    "freezing": {"options": {"freezing": True}},
    "max-autotune-no-cudagraphs": {"mode": "max-autotune-no-cudagraphs"},
    "max-autotune-freezing": {"options": {"freezing": True, "max_autotune": True}},
}
MAX_GRAPHS = 32  # dynamo's own limit (8 per function) would silently run eager past 8 capacities


def compile_mode(compile: bool | str | None) -> str | None:
    """`PromptCache(compile=...)` → a mode of MODES, or None (eager). None reads RAG_PROMPTCACHE_COMPILE
    (unset: eager); True is "default"; a string names the mode."""
    if compile is None:
        value = os.environ.get(ENV, "").strip().lower()
        if value in ("", "0", "false", "off"):
            return None
        compile = True if value in ("1", "true", "on") else value
    if compile is False:
        return None
    mode = "default" if compile is True else compile
    if mode not in MODES:
        raise ValueError(f"unknown compile mode {mode!r} (from compile= or {ENV}); "
                         f"valid: True/1 (default), False/0, {', '.join(MODES)}")
    return mode


def bucket(n: int) -> int:
    """The smallest of 256 x {1, 2, 3, 4, 6, 8, 12, 16, ...} holding `n` tokens (at most 1.5x of it past 512)."""
    size = CAPACITY_STEP
    while size < n:
        power = 1 << (size.bit_length() - 1)  # the largest power of two <= size
        size = power * 3 // 2 if size == power and power >= 2 * CAPACITY_STEP else 2 * power
    return size


def is_bucket(n: int) -> bool:
    return n >= CAPACITY_STEP and bucket(n) == n


def decode_one_token(lean: LeanLlama, token: torch.Tensor, position: torch.Tensor, index: torch.Tensor,
                     keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """token, position: [1, 1] long; index: [1] long, the cache slot this token's KV goes to;
    keys, values: per layer [1, Hkv, C, D], written at `index` in place → logits [V] fp32.

    Every slot after `index` is masked: it must hold finite values (`StaticDecoder.step` zeroes them)."""
    d, hkv, hq = lean.head_dim, lean.num_kv_heads, lean.num_heads
    x = lean.embed(token)  # [1, 1, E]
    cos, sin = lean.rotary(x, position)
    slots = torch.arange(keys[0].shape[2], device=x.device)
    mask = torch.zeros(1, 1, 1, slots.shape[0], dtype=x.dtype, device=x.device)  # [1, 1, 1, C], broadcast over rows
    mask = mask.masked_fill(slots > index, torch.finfo(x.dtype).min)
    for i, (layer, k_buf, v_buf) in enumerate(zip(lean.layers, keys, values)):
        q, k, v = lean.qkv[i](layer.input_layernorm(x))
        q = q.view(1, 1, hq, d).transpose(1, 2)  # [1, Hq, 1, D]
        k = k.view(1, 1, hkv, d).transpose(1, 2)  # [1, Hkv, 1, D]
        v = v.view(1, 1, hkv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k_buf.index_copy_(2, index, k)
        v_buf.index_copy_(2, index, v)
        # the group of q heads sharing KV head h become its rows, as in LeanLlama (no repeat of the cache)
        out = F.scaled_dot_product_attention(q.reshape(1, hkv, lean.group, d), k_buf, v_buf,
                                             attn_mask=mask, scale=lean.scale)
        x = x + lean.o[i](out.reshape(1, 1, hq * d))[0]
        x = x + lean.mlp(i, layer, x)
    return lean.head(lean.norm(x))[0][0, -1].float()


class StaticDecoder:
    """`decode_one_token` of one model, compiled (or eager with `mode=None`: the reference path).

    Not thread-safe by itself: the engine calls it under `model_lock`, as every forward pass."""

    def __init__(self, lean: LeanLlama, mode: str | None = "default") -> None:
        if mode is not None and mode not in MODES:
            raise ValueError(f"unknown compile mode {mode!r}; valid: {', '.join(MODES)}")
        self.lean = lean
        self.mode = mode
        self.capacities: set[int] = set()  # one compiled graph each
        self.compile_s: dict[int, float] = {}  # capacity → seconds its first call took (compile included)
        self.error: str | None = None  # why compiling failed; the step runs eagerly from then on
        self._fn = (decode_one_token if mode is None else
                    torch.compile(decode_one_token, dynamic=False, fullgraph=True, **MODES[mode]))
        self._lock = threading.Lock()

    @property
    def compiled(self) -> bool:
        return self.mode is not None and self.error is None

    def fits(self, cache: DynamicCache) -> bool:
        layers = cache.layers
        return (all(type(layer) is ReservedLayer for layer in layers) and is_bucket(layers[0]._keys.shape[2])
                and layers[0].length < layers[0]._keys.shape[2])

    @torch.inference_mode()
    def step(self, token: int, position: int, cache: DynamicCache) -> torch.Tensor:
        """Run one token at `position` into the next free slot of `cache` (`fits` must hold) → logits [V] fp32."""
        layers = cache.layers
        self.lean.refresh()
        n, capacity = layers[0].length, layers[0]._keys.shape[2]
        keys = [layer._keys for layer in layers]
        values = [layer._values for layer in layers]
        device = keys[0].device
        if getattr(cache, "_static_zeroed", -1) != n:
            # first static step on this cache (or after an eager one): garbage (NaN, inf) in unwritten
            # slots would leak through a masked softmax as NaN * 0, so zero them once; later steps only
            # ever write finite KV
            for k, v in zip(keys, values):
                k[:, :, n:].zero_()
                v[:, :, n:].zero_()
        args = (self.lean, torch.tensor([[token]], device=device), torch.tensor([[position]], device=device),
                torch.tensor([n], device=device), keys, values)
        logits = self._call(capacity, args)
        for layer in layers:
            layer._set_length(n + 1)
        cache._static_zeroed = n + 1  # the slots after n + 1 are still the zeros written above
        return logits

    def _call(self, capacity: int, args: tuple) -> torch.Tensor:
        if not self.compiled:
            return decode_one_token(*args)
        if capacity in self.capacities:
            return self._fn(*args)
        with self._lock:
            t0 = time.perf_counter()
            try:
                with torch._dynamo.config.patch(recompile_limit=MAX_GRAPHS, accumulated_recompile_limit=MAX_GRAPHS * 8):
                    out = self._fn(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: the eager step is always correct
                # the eager step recomputes this token: the failed call may or may not have written its KV,
                # and writing it again at the same slot is idempotent
                self.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                log.warning("torch.compile of the decode step failed (%s); decoding eagerly from now on", self.error)
                return decode_one_token(*args)
            self.capacities.add(capacity)
            self.compile_s[capacity] = time.perf_counter() - t0
        return out


_DECODERS: weakref.WeakKeyDictionary[PreTrainedModel, dict[str, StaticDecoder]] = weakref.WeakKeyDictionary()
_NO_LEAN_LOGGED: set[str] = set()


def static_decoder(model: PreTrainedModel, compile: bool | str | None) -> StaticDecoder | None:
    """The model's compiled decode step in `compile`'s mode (shared by every engine on the model, so a
    graph compiles once per process); None when compiling is off or the model has no lean forward."""
    mode = compile_mode(compile)
    if mode is None:
        return None
    lean = lean_forward(model)
    if lean is None:
        name = type(model).__name__
        if name not in _NO_LEAN_LOGGED:
            _NO_LEAN_LOGGED.add(name)
            log.warning("no static decode step for %s (only LlamaForCausalLM has one); decoding eagerly", name)
        return None
    per_mode = _DECODERS.setdefault(model, {})
    if mode not in per_mode:
        per_mode[mode] = StaticDecoder(lean, mode)
    return per_mode[mode]


def warm_up(decoder: StaticDecoder, model: PreTrainedModel, num_tokens: int) -> float:
    """Compile the graph for requests of up to `num_tokens` (prompt and answer) with a two-token dummy
    decode, so that a user's first question does not pay for it → seconds spent (0.0 when compiled)."""
    capacity = bucket(num_tokens)
    if not decoder.compiled or capacity in decoder.capacities:
        return 0.0
    t0 = time.perf_counter()
    g = kv_geometry(model)
    cache = DynamicCache(config=model.config)  # not from the pool, which may hand out a larger buffer
    shape = (1, g.num_kv_heads, capacity, g.head_dim)  # [1, Hkv, C, D] per layer
    with torch.inference_mode():  # as the engine's buffers: dynamo guards on it (else a second graph)
        cache.layers[:] = [ReservedLayer(torch.zeros(shape, dtype=model.dtype, device=model.device),
                                         torch.zeros(shape, dtype=model.dtype, device=model.device), 0)
                           for _ in range(g.num_layers)]
    for position in range(2):  # the second call proves the graph is reused, not recompiled
        decoder.step(0, position, cache)
    return time.perf_counter() - t0
