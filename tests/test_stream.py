"""Layer-wise loading of module KV (engine/kv/stream.py) against plain assembly: on CPU the per-layer
pipeline runs synchronously, each layer when the forward first writes it, and must give exactly the
cache and the logits plain assembly gives; on the `device` tier with CUDA, from pinned and pageable
host memory through the side stream."""

from __future__ import annotations

import pytest
import torch

from rag_promptcache.engine.compute.runner import forward_last
from rag_promptcache.engine.kv import stream
from rag_promptcache.engine.kv.assemble import assemble, release
from rag_promptcache.engine.kv.stream import assemble_for, assemble_streamed, load_all
from rag_promptcache.engine.prompt.compiler import Piece
from rag_promptcache.model.positions import kv_geometry, relocator_for
from rag_promptcache.store.base import ModuleKV
from tests.tiny import build


def _modules(model, device: str = "cpu", pin: bool = False) -> tuple[list[Piece], dict[str, ModuleKV]]:
    """Two modules encoded at 0 and placed elsewhere (one only in part, as recovery splits it), glue text
    between them and a question after: new tokens before a cached one, so assembly's mask is needed."""
    g = kv_geometry(model)
    gen = torch.Generator().manual_seed(3)
    kvs = {}
    for name, n in (("a", 12), ("b", 9)):
        shape = (g.num_layers, g.num_kv_heads, n, g.head_dim)
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        if pin:
            k, v = k.pin_memory(), v.pin_memory()
        kvs[name] = ModuleKV(k.to(device) if device != "cpu" else k, v.to(device) if device != "cpu" else v,
                             0, tuple(range(3, 3 + n)), "fp", "isolated")
    pieces = [
        Piece((1, 2), 0),  # new: the prefix
        Piece(tuple(range(3, 15)), 2, "a"),  # all of a, moved by 2
        Piece((5, 6, 7), 14),  # new: glue between the modules
        Piece(tuple(range(5, 10)), 17, "b", offset=2),  # part of b (tokens 2..6), moved by 15
        Piece((20, 21, 22, 23), 22),  # new: the question
    ]
    return pieces, kvs


def _both(model, pieces, kvs, device):
    args = (pieces, kvs, relocator_for(model), model.config, kv_geometry(model), torch.device(device), model.dtype)
    return assemble(*args, extra=4), assemble_streamed(*args, extra=4)


def test_streamed_assembly_loads_each_layer_when_the_forward_reaches_it_and_equals_plain_assembly():
    model = build("llama")
    pieces, kvs = _modules(model)
    plain, streamed = _both(model, pieces, kvs, "cpu")
    layers = streamed.cache.layers
    assert all(layer.pending is not None for layer in layers)  # nothing loaded before the forward asks...
    assert streamed.num_cached == plain.num_cached == 17
    assert torch.equal(streamed.new_ids, plain.new_ids) and torch.equal(streamed.new_positions, plain.new_positions)
    assert torch.equal(streamed.mask, plain.mask)
    want = forward_last(model, plain.new_ids, plain.new_positions, plain.cache, plain.mask)
    got = forward_last(model, streamed.new_ids, streamed.new_positions, streamed.cache, streamed.mask)
    assert all(layer.pending is None for layer in layers)  # ...and every layer loaded by it
    assert torch.equal(got, want)
    for a, b in zip(plain.cache.layers, layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    release(plain.cache)
    release(streamed.cache)


def test_the_loader_keeps_a_few_layers_ahead_and_load_all_finishes_the_rest(monkeypatch):
    monkeypatch.setattr(stream, "AHEAD", 1)
    model = build("llama", num_hidden_layers=4)
    pieces, kvs = _modules(model)
    plain, streamed = _both(model, pieces, kvs, "cpu")
    loaded: list[int] = []
    real = stream.LayerLoader._load
    monkeypatch.setattr(stream.LayerLoader, "_load", lambda self, i: loaded.append(i) or real(self, i))
    layers = streamed.cache.layers
    layers[0].pending()  # the forward's first write into layer 0
    layers[0].pending = None
    assert loaded == [1]  # layer 0 was started by the assembly; layer 1 one ahead of it now
    load_all(streamed.cache)
    assert loaded == [1, 2, 3] and all(layer.pending is None for layer in layers)
    for a, b in zip(plain.cache.layers, layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    release(plain.cache)
    release(streamed.cache)


def test_assemble_for_streams_only_on_cuda_with_host_kv_and_new_tokens():
    model = build("llama")
    pieces, kvs = _modules(model)
    args = (kvs, relocator_for(model), model.config, kv_geometry(model))
    on_cpu = assemble_for(pieces, *args, torch.device("cpu"), model.dtype)
    assert all(layer.pending is None for layer in on_cpu.cache.layers)  # a CPU model: plain assembly
    release(on_cpu.cache)


def test_streamed_assembly_on_cuda_from_pinned_pageable_and_device_memory_equals_plain(device):
    if not device.startswith("cuda"):
        pytest.skip("the side stream and pinned copies run on CUDA only; the CPU tests above run the pipeline")
    model = build("llama", device)
    for where, pin in (("cpu", True), ("cpu", False), (device, False)):
        pieces, kvs = _modules(model, where, pin)
        args = (kvs, relocator_for(model), model.config, kv_geometry(model), torch.device(device), model.dtype)
        plain = assemble(pieces, *args, extra=4)
        streamed = assemble_for(pieces, *args, extra=4)
        assert any(layer.pending is not None for layer in streamed.cache.layers) == (where == "cpu"), f"{where=}"
        want = forward_last(model, plain.new_ids, plain.new_positions, plain.cache, plain.mask)
        got = forward_last(model, streamed.new_ids, streamed.new_positions, streamed.cache, streamed.mask)
        assert torch.allclose(got, want, atol=1e-5, rtol=0), f"{where=} {pin=} {(got - want).abs().max()=}"
        for a, b in zip(plain.cache.layers, streamed.cache.layers):
            assert torch.allclose(a.keys, b.keys, atol=1e-6, rtol=0) and torch.equal(a.values, b.values)
        release(plain.cache)
        release(streamed.cache)
