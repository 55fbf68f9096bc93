"""Module KV to the GPU layer by layer, overlapped with the prefill of the new tokens (LMCache's layer-wise loading).

Plain assembly (assemble.py) copies every cached module's KV into the request's cache before the
prefill starts. Where the stored modules sit in host memory and the model on a GPU, that copy crosses
the host link, and the prefill waits for all of it although its layer 0 needs only layer 0's KV. Here
each layer's KV travels on its own:

- a side stream copies layer l of every module to the device (`non_blocking`: from pinned memory
  straight, as `MemoryStore` keeps entries where CUDA is present; from pageable memory through one of
  a ring of pinned staging buffers), places each piece in the request's reserved cache, relocates the
  layer's keys with one rotation over its cached tokens, and records an event;
- the reserved cache's layer l waits for that event before the forward first writes into it
  (`ReservedLayer.pending`), and asks for layer l + `AHEAD` to be started: the host keeps a few layers
  ahead of the forward it is launching, the GPU computes layer l while layer l + 1 crosses the link.

`assemble_for` is what the prefill calls: streamed where the device is CUDA, a cached piece's KV is in
host memory and new tokens will run (their forward is what waits); plain assembly otherwise (every
module already on the device, e.g. in a `DeviceStore` tier, or a CPU model). `load_all` finishes what a
streamed cache still has pending (a caller that reads the cache without running a forward).

On CPU `assemble_streamed` runs the same per-layer steps synchronously, each when its turn comes, so
the tests hold its cache exactly equal to plain assembly's (tests/test_stream.py).

Out of scope: caches that are not reserved buffers (chunked or linear attention: plain assembly), codecs decoded
on the device, several requests' loads sharing one link.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence

import torch
from transformers import PretrainedConfig

from rag_promptcache.engine.kv.assemble import Assembled, ReservedLayer, Reservation, assemble, assembly_mask
from rag_promptcache.engine.prompt.compiler import Piece
from rag_promptcache.model.positions import KVGeometry, Relocator, RopeRelocator
from rag_promptcache.store.base import ModuleKV

AHEAD = 2  # layers started ahead of the one the forward is about to write
STAGING_SLOTS = 3  # pinned staging buffers in the ring (pageable sources only)


def assemble_for(pieces: Sequence[Piece], kvs: Mapping[str, ModuleKV], relocator: Relocator,
                 config: PretrainedConfig, geometry: KVGeometry, device: torch.device, dtype: torch.dtype,
                 extra: int = 0) -> Assembled:
    """The prefill's assembly: `assemble_streamed` where it pays (module KV in host memory, a CUDA model,
    new tokens to run), else plain `assemble`. Same arguments as `assemble`."""
    if device.type == "cuda" and any(not p.cached for p in pieces) and any(
            p.cached and kvs[p.unit].keys.device.type == "cpu" for p in pieces):
        streamed = assemble_streamed(pieces, kvs, relocator, config, geometry, device, dtype, extra)
        if streamed is not None:
            return streamed
    return assemble(pieces, kvs, relocator, config, geometry, device, dtype, extra)


def assemble_streamed(pieces: Sequence[Piece], kvs: Mapping[str, ModuleKV], relocator: Relocator,
                      config: PretrainedConfig, geometry: KVGeometry, device: torch.device, dtype: torch.dtype,
                      extra: int = 0) -> Assembled | None:
    """`assemble`'s result with each layer's KV loaded when the forward first needs it (see above);
    None where the cache needs transformers' own layers (chunked or linear attention)."""
    lay = Reservation.of(pieces, config, geometry, device, dtype, extra)
    if lay.reserved is None:
        return None
    cache, keys, values = lay.reserved
    loader = LayerLoader(lay.cached, kvs, relocator, keys, values)
    for i, layer in enumerate(cache.layers):
        layer.set_length(lay.num_cached)
        layer.pending = lambda i=i: loader.wait(i)
    loader.start()
    return lay.assembled(cache, pieces, geometry, mask=assembly_mask(pieces, geometry, dtype, device))


def load_all(cache) -> None:
    """Run every layer's pending load now (a streamed cache read without a forward)."""
    for layer in cache.layers:
        if type(layer) is ReservedLayer and layer.pending is not None:
            pending, layer.pending = layer.pending, None
            pending()


class LayerLoader:
    """The per-layer copies of one assembly: `start` begins the first layers, `wait(l)` makes the
    current stream wait for layer l (started now if it was not) and starts layer l + AHEAD."""

    def __init__(self, cached: Sequence[Piece], kvs: Mapping[str, ModuleKV], relocator: Relocator,
                 keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values: the reserved cache's buffers [L, H, capacity, D], the cached pieces going first."""
        self.keys, self.values = keys, values
        self.num_layers = keys.shape[0]
        self.device = keys.device
        self.cuda = keys.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=keys.device) if self.cuda else None
        if self.stream is not None:  # the buffers were written on the current stream before (pool reuse)
            self.stream.wait_stream(torch.cuda.current_stream(keys.device))
        self.events: list[torch.cuda.Event | None] = [None] * self.num_layers
        self.num_started = 0
        # (module, offset, tokens, slot in the cache) per cached piece, in cache order
        self.places: list[tuple[ModuleKV, int, int, int]] = []
        shifts: list[torch.Tensor] = []
        at = 0
        for p in cached:
            kv, n = kvs[p.unit], len(p.token_ids)
            self.places.append((kv, p.offset, n, at))
            shifts.append(torch.full((n,), p.position - (kv.start + p.offset), dtype=torch.long))
            at += n
        self.num_cached = at
        deltas = torch.cat(shifts) if shifts else torch.zeros(0, dtype=torch.long)
        self.deltas = deltas.to(keys.device) if bool(deltas.any()) else None  # None: nothing moves
        self.relocators = [_one_layer(relocator, i, keys.device) for i in range(self.num_layers)]
        pageable = any(kv.keys.device.type == "cpu" and not kv.keys.is_pinned() for kv, *_ in self.places)
        self.staging = _Staging() if self.cuda and pageable else None
        self._lock = threading.Lock()

    def start(self) -> None:
        for _ in range(min(AHEAD, self.num_layers)):
            self._start_next()

    def wait(self, layer: int) -> None:
        with self._lock:
            while self.num_started <= min(layer + AHEAD, self.num_layers - 1):
                self._start_next()
        event = self.events[layer]
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def _start_next(self) -> None:
        i = self.num_started
        self.num_started += 1
        if self.stream is None:
            self._load(i)
            return
        with torch.cuda.stream(self.stream):
            self._load(i)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[i] = event

    @torch.inference_mode()
    def _load(self, i: int) -> None:
        keys, values = self.keys[i], self.values[i]  # [H, capacity, D]
        for kv, off, n, at in self.places:
            k, v = self._on_device(kv.keys[i]), self._on_device(kv.values[i])  # [H, S, D]
            keys[:, at : at + n] = k[:, off : off + n]
            values[:, at : at + n] = v[:, off : off + n]
        if self.deltas is not None:  # the layer's cached keys, relocated in one rotation
            span = keys[None, :, : self.num_cached]  # [1, H, C, D]
            span.copy_(self.relocators[i].rotate(span, self.deltas))

    def _on_device(self, x: torch.Tensor) -> torch.Tensor:
        """One layer of a module [H, S, D] on the cache's device: as it is (already there), a non-blocking
        copy (pinned), or through the staging ring (pageable)."""
        if x.device == self.device:
            return x
        if self.staging is None or x.is_pinned():
            return x.to(self.device, non_blocking=self.cuda)
        return self.staging.copy(x, self.device, self.stream)


class _Staging:
    """A ring of pinned host buffers for pageable sources: one is refilled only once the copy out of it
    that was queued before has finished (its event), so the host never overwrites data in flight."""

    def __init__(self, slots: int = STAGING_SLOTS) -> None:
        self.buffers: list[torch.Tensor | None] = [None] * slots
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.next = 0

    def copy(self, x: torch.Tensor, device: torch.device, stream: torch.cuda.Stream) -> torch.Tensor:
        slot = self.next
        self.next = (slot + 1) % len(self.buffers)
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        buf = self.buffers[slot]
        if buf is None or buf.numel() < x.numel() or buf.dtype != x.dtype:
            buf = self.buffers[slot] = torch.empty(max(x.numel(), 1), dtype=x.dtype).pin_memory()
        staged = buf[: x.numel()].view(x.shape)
        staged.copy_(x)
        out = staged.to(device, non_blocking=True)
        self.events[slot] = torch.cuda.Event()
        self.events[slot].record(stream)
        return out


def _one_layer(relocator: Relocator, layer: int, device: torch.device) -> Relocator:
    """`relocator` for one layer's keys [1, H, S, D] on `device` (RoPE relocators rotate every layer's at
    once, each by its own base)."""
    if isinstance(relocator, RopeRelocator):
        return dataclasses.replace(relocator, inv_freq=relocator.inv_freq.to(device),
                                   layer_base=relocator.layer_base[layer : layer + 1].to(device))
    return relocator
