"""Decode steps without launch overhead on CUDA: one step over static KV buffers, replayed as a CUDA graph.

One eager decode step of a small model on a GPU is hundreds of small kernel launches driven from
Python, and the GPU waits on them. A CUDA graph replays a captured step in one launch. A graph bakes in
every tensor's address and shape, so the step it captures reads and writes static buffers only
(gpt-fast's design, with the graph captured by hand per shape rather than by `torch.compile`: nothing
to compile in a device call of minutes, and no guard on mutated inputs to trip):

- `StaticKV`: keys, values [L, B, H, C, D] (C slots per row), the step's inputs ids, positions [B, K]
  and lengths [B] (tokens of KV each row holds before the step).
- `static_step(lean, kv, rows, tokens)`: one step as a function of those buffers alone. Each row's new
  K/V is scattered in at its own length, and attention runs over all C slots with a mask made inside
  the step from `lengths`, so no shape depends on a Python number. On CPU it runs eagerly; its logits
  equal the lean forward's (tests/test_graphs.py).
- `Graphs`: `static_step` captured into a `torch.cuda.CUDAGraph` per (rows, tokens) on first use and
  replayed after (`capture=False`: run eagerly, the same bookkeeping, for the CPU tests).

Two users:
- `SequenceStep`, the single-request loop's step (engine/decoding/decode.py): the prompt's KV is copied
  into a static buffer of its size bucket when decoding starts, and the answer's KV back into the
  request's cache when it ends (the prefix cache keeps it from there). A prompt lookup draft is padded
  to one width, so two graphs (one token; the widest draft) serve every step; rejected tokens are
  dropped by setting the length back.
- `batch_graphs` for the batched step (engine/batching/batch.py): the batch cache's buffers are static
  already; one graph per number of running rows, captured again when the cache grows.

`step_for(model, cache, room=, width=)` picks: `SequenceStep` on CUDA for a model with the lean forward
and a reserved cache, unless RAG_PROMPTCACHE_CUDA_GRAPHS=0; else `EagerStep`, the forward as before.
The CPU path and its native kernels are untouched.

Out of scope: prefill (eager, as in gpt-fast), models without the lean forward, sliding windows.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rag_promptcache.engine.compute.forward import LeanLlama
from rag_promptcache.model.rotary import apply_rotary_pos_emb
from rag_promptcache.engine.compute.runner import forward_logits, lean_forward
from rag_promptcache.engine.kv.assemble import ReservedLayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

GRAPHS_ENV = "RAG_PROMPTCACHE_CUDA_GRAPHS"  # "0": every decode step eager, as on CPU
BUCKET = 1024  # static buffers come in capacities of whole buckets, so requests of similar length share graphs


def graphs_enabled(device: torch.device) -> bool:
    """Whether decode steps on `device` run as CUDA graphs: CUDA, unless $RAG_PROMPTCACHE_CUDA_GRAPHS is 0."""
    if device.type != "cuda":
        return False
    return os.environ.get(GRAPHS_ENV, "1").strip().lower() not in ("0", "false", "off")


@dataclass(frozen=True, slots=True, eq=False)
class StaticKV:
    """The buffers one step reads and writes; their addresses never change."""

    keys: torch.Tensor  # [L, B, H, C, D]
    values: torch.Tensor  # [L, B, H, C, D]
    ids: torch.Tensor  # [B, K] int64
    positions: torch.Tensor  # [B, K] int64
    lengths: torch.Tensor  # [B] int64: tokens of KV per row before the step

    @classmethod
    @torch.inference_mode()  # every write to these happens in the mode
    def empty(cls, lean: LeanLlama, rows: int, capacity: int, width: int, dtype: torch.dtype,
              device: torch.device) -> StaticKV:
        num_layers, heads, dim = len(lean.layers), lean.num_kv_heads, lean.head_dim
        keys = torch.zeros(num_layers, rows, heads, capacity, dim, dtype=dtype, device=device)
        return cls(keys, torch.zeros_like(keys), *cls.inputs(rows, width, device))

    @staticmethod
    @torch.inference_mode()
    def inputs(rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Zeroed ids, positions [rows, width] and lengths [rows]."""
        ids = torch.zeros(rows, width, dtype=torch.long, device=device)
        return ids, torch.zeros_like(ids), torch.zeros(rows, dtype=torch.long, device=device)

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]


def static_step(lean: LeanLlama, kv: StaticKV, rows: int, tokens: int) -> torch.Tensor:
    """The first `tokens` inputs of the first `rows` rows of `kv`, each row at its own length → logits
    [rows, tokens, V] fp32. Writes their K/V at slots lengths[b] .. lengths[b] + tokens - 1; leaves
    `lengths` as it was (the caller moves it)."""
    ids, positions, lengths = kv.ids[:rows, :tokens], kv.positions[:rows, :tokens], kv.lengths[:rows]
    b, n, d, hkv, hq, g = rows, tokens, lean.head_dim, lean.num_kv_heads, lean.num_heads, lean.group
    device = ids.device
    x = lean.embed(ids)  # [b, n, E]
    cos, sin = lean.rotary(x, positions)
    slot = lengths[:, None] + torch.arange(n, device=device)  # [b, n]: where each new token's K/V goes
    seen = torch.arange(kv.capacity, device=device)[None, None, :] <= slot[:, :, None]  # [b, n, C]
    mask = torch.zeros(seen.shape, dtype=x.dtype, device=device).masked_fill_(~seen, torch.finfo(x.dtype).min)
    mask = mask[:, None].repeat(1, 1, g, 1)  # [b, 1, g * n, C]: rows of the folded query heads
    index = slot[:, None, :, None].expand(b, hkv, n, d)
    for i, layer in enumerate(lean.layers):
        q, k, v = lean.qkv[i](layer.input_layernorm(x))
        q = q.view(b, n, hq, d).transpose(1, 2)  # [b, Hq, n, D]
        k = k.view(b, n, hkv, d).transpose(1, 2)  # [b, Hkv, n, D]
        v = v.view(b, n, hkv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, values = kv.keys[i, :b], kv.values[i, :b]  # [b, Hkv, C, D], views of the static buffers
        keys.scatter_(2, index, k.to(keys.dtype))
        values.scatter_(2, index, v.to(values.dtype))
        # q heads h*g .. h*g+g-1 share KV head h: folded into rows, as the lean forward does
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, g * n, d), keys, values, attn_mask=mask,
                                             scale=lean.scale)
        out = out.reshape(b, hq, n, d).transpose(1, 2).reshape(b, n, hq * d)
        x = x + lean.o[i](out)[0]
        x = x + lean.mlp(i, layer, x)
    return lean.head(lean.norm(x))[0].float()


class Graphs:
    """`static_step` over one `StaticKV`, captured as a CUDA graph per (rows, tokens) on first use.
    `capture=False` runs the step eagerly instead (the CPU tests). All graphs share one memory pool:
    they replay one at a time, on the stream that captured them."""

    def __init__(self, lean: LeanLlama, kv: StaticKV, *, capture: bool = True) -> None:
        if capture and kv.keys.device.type != "cuda":
            raise ValueError(f"CUDA graphs need CUDA buffers, got {kv.keys.device}; "
                             "capture=False runs the step eagerly")
        self.lean, self.kv, self.capture = lean, kv, capture
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: tuple[int, int] | None = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def run(self, rows: int, tokens: int) -> torch.Tensor:
        """The step over the inputs already in `kv` → logits [rows, tokens, V], valid until the next run."""
        if not self.capture:
            return static_step(self.lean, self.kv, rows, tokens)
        key = (rows, tokens)
        if key not in self._graphs:
            self._graphs[key] = self._capture(rows, tokens)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, rows: int, tokens: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # warm-up on a side stream (cuBLAS and allocator state), as torch.cuda.graph's docs require; it runs
        # this very step, and the replay after capture writes the same K/V again
        side = torch.cuda.Stream(device=self.kv.keys.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            static_step(self.lean, self.kv, rows, tokens)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work meanwhile (an assembly, a store's copy) does not void the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = static_step(self.lean, self.kv, rows, tokens)
        self._pool = graph.pool()
        return graph, out


class EagerStep:
    """The decode loop's step as it always ran: the forward over the request's own cache."""

    def __init__(self, model: PreTrainedModel, cache: DynamicCache) -> None:
        self.model, self.cache = model, cache

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions [1, m] → logits [m, V] fp32."""
        return forward_logits(self.model, ids, positions, self.cache, keep=ids.shape[1])

    def crop(self, num_tokens: int) -> None:
        self.cache.crop(-num_tokens)

    def close(self) -> None:
        pass


class SequenceStep:
    """One request's decode steps on a static buffer of its size bucket (taken from `_SEQUENCES`, given
    back on `close`), as graphs where `capture`: the prompt's KV copied in at the start, the answer's
    copied back into the request's reserved cache on `close`."""

    def __init__(self, lean: LeanLlama, cache: DynamicCache, room: int, width: int, *, capture: bool = True) -> None:
        """`room`: tokens the answer may still add; `width`: the most tokens one step feeds (1 + lookup)."""
        layers = cache.layers
        assert all(type(layer) is ReservedLayer for layer in layers), "a static step needs a reserved cache"
        self.cache, self.width = cache, width
        self.start = self.length = layers[0].length
        capacity = -(-(self.start + room + width) // BUCKET) * BUCKET
        self.held = _SEQUENCES.take(lean, capacity, width, layers[0].dtype, layers[0].device, capture)
        kv = self.held.kv
        with torch.inference_mode():
            for i, layer in enumerate(layers):  # layer.keys: [1, H, n, D]
                kv.keys[i, 0, :, : self.start] = layer.keys[0]
                kv.values[i, 0, :, : self.start] = layer.values[0]

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """ids, positions [1, m], m <= width → logits [m, V] fp32. A draft runs padded to `width` tokens
        (its last id repeated, positions counting on): the padding comes after the draft, so its rows'
        logits are those of the draft alone, and its K/V lies past the length the caller keeps."""
        m = ids.shape[1]
        assert m <= self.width, f"{m=} {self.width=}"
        kv = self.held.kv
        assert self.length + self.width <= kv.capacity, f"{self.length=} {self.width=} {kv.capacity=}"
        tokens = 1 if m == 1 else self.width
        kv.ids[0, :m] = ids[0]
        kv.ids[0, m:tokens] = ids[0, -1]
        kv.positions[0, :tokens] = torch.arange(tokens, device=ids.device) + positions[0, 0]
        kv.lengths.fill_(self.length)
        logits = self.held.graphs.run(1, tokens)[0, :m].clone()  # [m, V]: the next replay overwrites the output
        self.length += m
        return logits

    def crop(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= self.length - self.start, f"{num_tokens=} {self.length=} {self.start=}"
        self.length -= num_tokens

    @torch.inference_mode()
    def close(self) -> None:
        """The answer's K/V into the request's cache (its owner keeps or releases it), the buffer back."""
        if self.held is None:
            return
        kv, a, b = self.held.kv, self.start, self.length
        if b > a:
            for i, layer in enumerate(self.cache.layers):
                layer.update(kv.keys[i, :1, :, a:b], kv.values[i, :1, :, a:b])
        _SEQUENCES.give(self.held)
        self.held = None


@dataclass(frozen=True, slots=True, eq=False)
class _Held:
    kv: StaticKV
    graphs: Graphs
    key: tuple


class _Sequences:
    """Static single-sequence buffers and their graphs, per (model, capacity, width, dtype, device, capture):
    one request holds one at a time; at most `per_key` free ones are kept (graphs hold their memory)."""

    def __init__(self, per_key: int = 1) -> None:
        self.per_key = per_key
        self._free: weakref.WeakKeyDictionary[LeanLlama, dict[tuple, list[_Held]]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def take(self, lean: LeanLlama, capacity: int, width: int, dtype: torch.dtype, device: torch.device,
             capture: bool) -> _Held:
        # the head's weight address: a model moved by `.to()` after a capture gets new graphs
        key = (capacity, width, dtype, str(device), capture, lean.lm_head.weight.data_ptr())
        with self._lock:
            free = self._free.setdefault(lean, {}).get(key, [])
            if free:
                return free.pop()
        kv = StaticKV.empty(lean, 1, capacity, width, dtype, device)
        return _Held(kv, Graphs(lean, kv, capture=capture), key)

    def give(self, held: _Held) -> None:
        with self._lock:
            free = self._free.setdefault(held.graphs.lean, {}).setdefault(held.key, [])
            if len(free) < self.per_key:
                free.append(held)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


_SEQUENCES = _Sequences()


def step_for(model: PreTrainedModel, cache: DynamicCache, *, room: int, width: int) -> EagerStep | SequenceStep:
    """The decode loop's step for `cache`: CUDA graphs where they run (`graphs_enabled`, the lean forward,
    a reserved cache), else the eager forward. `room`: tokens the answer may still add; `width`: the
    most tokens one step feeds."""
    lean = lean_forward(model)
    if (lean is None or not graphs_enabled(model.device)
            or not all(type(layer) is ReservedLayer for layer in cache.layers)):
        return EagerStep(model, cache)
    lean.refresh()
    return SequenceStep(lean, cache, room, width)


class BatchGraphs:
    """The batched decode step (engine/batching/batch.py) as CUDA graphs over the batch cache's own
    buffers: one graph per number of running rows; `for_buffers` starts over when the cache grew."""

    def __init__(self, lean: LeanLlama, keys: torch.Tensor, values: torch.Tensor, *, capture: bool = True) -> None:
        """keys, values: the batch cache's [L, B, H, C, D]."""
        self.kv = StaticKV(keys, values, *StaticKV.inputs(keys.shape[1], 1, keys.device))
        self.graphs = Graphs(lean, self.kv, capture=capture)

    def holds(self, keys: torch.Tensor) -> bool:
        return self.kv.keys is keys

    @torch.inference_mode()
    def __call__(self, ids: list[int], positions: list[int], lengths: list[int]) -> torch.Tensor:
        """One token for each of the first n rows, each at its own length → logits [n, V] fp32."""
        n, kv = len(ids), self.kv
        kv.ids[:n, 0] = torch.tensor(ids, device=kv.ids.device)
        kv.positions[:n, 0] = torch.tensor(positions, device=kv.ids.device)
        kv.lengths[:n] = torch.tensor(lengths, device=kv.ids.device)
        return self.graphs.run(n, 1)[:, 0].clone()


_BATCH: weakref.WeakKeyDictionary[object, BatchGraphs] = weakref.WeakKeyDictionary()


def batch_graphs(model: PreTrainedModel, owner: object, keys: torch.Tensor, values: torch.Tensor) -> BatchGraphs | None:
    """`owner`'s (a batch cache's) `BatchGraphs` over its current buffers, or None where graphs do not run."""
    lean = lean_forward(model)
    if lean is None or not graphs_enabled(keys.device):
        return None
    lean.refresh()
    held = _BATCH.get(owner)
    if held is None or not held.holds(keys):
        held = _BATCH[owner] = BatchGraphs(lean, keys, values)
    return held
