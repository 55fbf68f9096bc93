"""The decode step over static buffers (engine/compute/graphs.py) against the lean forward, on CPU; the
CUDA graphs of it on the `device` tier where that is CUDA (skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.batching.batch import BatchCache, decode_step
from rag_promptcache.engine.compute import graphs
from rag_promptcache.engine.compute.graphs import (
    GRAPHS_ENV, BatchGraphs, EagerStep, Graphs, SequenceStep, StaticKV, graphs_enabled, static_step, step_for,
)
from rag_promptcache.engine.compute.runner import forward_last, forward_logits, lean_forward
from rag_promptcache.engine.decoding import decode as decode_module
from rag_promptcache.engine.kv.assemble import release, reserved_cache
from rag_promptcache.model.positions import kv_geometry
from tests.tiny import build

TOL = 1e-4  # fp32: masked slots add exactly 0; the static step's matmuls round as batched ones do
REPEATS = ('<schema name="s"><module name="a">one two three four five six seven eight nine ten one two three '
           'four five six seven eight nine ten</module></schema>')
PROMPT = '<prompt schema="s"><a/><user>one two three four five six</user></prompt>'


def _prefilled(model, ids: torch.Tensor, n: int, capacity: int = 64):
    cache, _, _ = reserved_cache(model.config, kv_geometry(model), capacity, model.dtype, model.device)
    forward_last(model, ids[:, :n], torch.arange(n, device=model.device)[None], cache)
    return cache


@torch.inference_mode()
def _static(model, caches: list, capacity: int, width: int) -> StaticKV:
    lean = lean_forward(model)
    kv = StaticKV.empty(lean, len(caches), capacity, width, model.dtype, model.device)
    for b, cache in enumerate(caches):
        for i, layer in enumerate(cache.layers):
            n = layer.length
            kv.keys[i, b, :, :n] = layer.keys[0]
            kv.values[i, b, :, :n] = layer.values[0]
    return kv


def test_static_step_logits_equal_the_lean_forward_one_token_a_draft_and_rows_at_their_own_lengths():
    model = build("llama")
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(1))
    lengths = [20, 27, 9]
    caches = [_prefilled(model, ids[b : b + 1], n) for b, n in enumerate(lengths)]
    kv = _static(model, caches, capacity=64, width=4)
    lean = lean_forward(model)
    with torch.inference_mode():  # the static buffers are inference tensors: written in the mode
        # every row one token, each at its own length
        kv.ids[:, 0] = ids[torch.arange(3), torch.tensor(lengths)]
        kv.positions[:, 0] = torch.tensor(lengths)
        kv.lengths[:] = torch.tensor(lengths)
        got = static_step(lean, kv, 3, 1)  # [3, 1, V]
    for b, n in enumerate(lengths):
        want = forward_logits(model, ids[b : b + 1, n : n + 1], torch.tensor([[n]]), caches[b])
        assert torch.allclose(got[b, 0], want[0], atol=TOL, rtol=0), f"{b=} {(got[b, 0] - want[0]).abs().max()=}"
    # then a four-token draft on row 0 after its new token
    with torch.inference_mode():
        kv.ids[0] = ids[0, 21:25]
        kv.positions[0] = torch.arange(21, 25)
        kv.lengths[0] = 21
        got = static_step(lean, kv, 1, 4)[0]  # [4, V]
    want = forward_logits(model, ids[:1, 21:25], torch.arange(21, 25)[None], caches[0], keep=4)
    assert torch.allclose(got, want, atol=TOL, rtol=0), f"{(got - want).abs().max()=}"
    # what the step wrote is what the forward wrote
    for i, layer in enumerate(caches[0].layers):
        assert torch.allclose(kv.keys[i, 0, :, :25], layer.keys[0], atol=1e-5, rtol=0)
        assert torch.allclose(kv.values[i, 0, :, :25], layer.values[0], atol=1e-5, rtol=0)
    for cache in caches:
        release(cache)


def _decode_with(model, engine: PromptCache, make_step, monkeypatch) -> tuple[tuple[int, ...], list[torch.Tensor]]:
    """Greedy decode of PROMPT with the loop's step made by `make_step` → (tokens, the cache's keys after)."""
    kept: list[torch.Tensor] = []
    real_keep = type(engine).keep_kv.__get__(engine)

    def keep(plan, prefix, state, keys, values, length):
        kept.extend(k[:, :length].clone() for k in keys)
        return real_keep(plan, prefix, state, keys, values, length)

    monkeypatch.setattr(decode_module, "step_for", make_step)
    monkeypatch.setattr(engine, "keep_kv", keep)
    res = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    return res.token_ids, kept


def test_the_decode_loop_on_a_static_sequence_step_gives_the_eager_loops_tokens_and_kv(tokenizer, monkeypatch):
    """SequenceStep with the graph capture off: the prompt's KV copied in, drafts padded to the lookup
    width, rejected tokens dropped by length, the answer's KV copied back for the prefix cache."""
    model = build("llama", vocab_size=len(tokenizer))
    engine = PromptCache(model, tokenizer, fallback="never", prompt_lookup=4, prefix_cache_bytes=0)
    engine.add_schema(REPEATS)
    made: list[SequenceStep] = []

    def static(model, cache, *, room, width):
        made.append(SequenceStep(lean_forward(model), cache, room, width, capture=False))
        return made[-1]

    eager_tokens, eager_kv = _decode_with(model, engine, lambda model, cache, **kw: EagerStep(model, cache), monkeypatch)
    tokens, kv = _decode_with(model, engine, static, monkeypatch)
    assert tokens == eager_tokens and len(tokens) == 24
    assert made and made[0].width == 5 and made[0].held is None  # closed: the buffer went back
    assert len(kv) == len(eager_kv) and all(a.shape == b.shape for a, b in zip(kv, eager_kv))
    for a, b in zip(kv, eager_kv):
        assert torch.allclose(a, b, atol=1e-5, rtol=0), f"{(a - b).abs().max()=}"


def test_a_sequence_step_pads_a_draft_drops_rejected_tokens_and_hands_the_answer_back():
    model = build("llama")
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(4))
    eager, static = _prefilled(model, ids, 20), _prefilled(model, ids, 20)
    steps = [EagerStep(model, eager), SequenceStep(lean_forward(model), static, room=12, width=5, capture=False)]
    outs = [[], []]
    for step, out in zip(steps, outs):
        out.append(step(ids[:, 20:21], torch.tensor([[20]])))  # one token
        out.append(step(ids[:, 21:24], torch.tensor([[21, 22, 23]])))  # a draft of two after it: padded to 5
        step.crop(1)  # the draft's last token rejected
        out.append(step(ids[:, 23:24], torch.tensor([[23]])))
        step.close()
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=TOL, rtol=0), f"{(a - b).abs().max()=}"
    assert steps[1].held is None
    for a, b in zip(eager.layers, static.layers):
        assert a.length == b.length == 24
        assert torch.allclose(a.keys, b.keys, atol=1e-5, rtol=0) and torch.allclose(a.values, b.values, atol=1e-5, rtol=0)
    release(eager)
    release(static)


def test_batch_graphs_without_capture_equal_the_eager_batched_step(tokenizer):
    model = build("llama")
    ids = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(2))
    lengths = [12, 30, 5]
    caches = [_prefilled(model, ids[b : b + 1], n) for b, n in enumerate(lengths)]
    eager, static = (BatchCache(model.config, kv_geometry(model), 4, 64, model.dtype, model.device) for _ in range(2))
    for batch in (eager, static):
        for b, cache in enumerate(caches):
            batch.load(b, cache)
    step = BatchGraphs(lean_forward(model), static.keys, static.values, capture=False)
    for t in range(3):  # three steps of all three rows
        toks = [int(ids[b, lengths[b] + t]) for b in range(3)]
        pos = [lengths[b] + t for b in range(3)]
        want = decode_step(model, eager, toks, pos)
        got = step(toks, pos, static.lengths[:3])
        for b in range(3):
            static.lengths[b] += 1
        assert torch.allclose(got, want, atol=TOL, rtol=0), f"{t=} {(got - want).abs().max()=}"


def test_on_cpu_the_loop_keeps_the_eager_forward_and_the_cuda_wrapper_refuses_cleanly(monkeypatch):
    model = build("llama")
    cache = _prefilled(model, torch.randint(0, 128, (1, 16)), 16)
    assert not graphs_enabled(torch.device("cpu"))
    assert isinstance(step_for(model, cache, room=8, width=9), EagerStep)
    assert graphs.batch_graphs(model, object(), torch.zeros(2, 1, 2, 4, 16), torch.zeros(2, 1, 2, 4, 16)) is None
    kv = StaticKV.empty(lean_forward(model), 1, 64, 1, model.dtype, model.device)
    with pytest.raises(ValueError, match="CUDA graphs need CUDA buffers"):
        Graphs(lean_forward(model), kv)
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert not graphs_enabled(torch.device("cuda"))
    monkeypatch.setenv(GRAPHS_ENV, "1")
    assert graphs_enabled(torch.device("cuda"))
    release(cache)


# -- the device tier: CUDA graphs for real ----------------------------------------------------------

def _cuda_only(device: str) -> None:
    if not device.startswith("cuda"):
        pytest.skip("CUDA graphs run on CUDA only; the CPU tests above cover the static step itself")


def test_cuda_graph_step_equals_eager_and_the_engine_answers_the_same(device, tokenizer, monkeypatch):
    _cuda_only(device)
    model = build("llama", device)
    ids = torch.randint(0, 128, (1, 40), device=device)
    cache = _prefilled(model, ids, 20)
    kv = _static(model, [cache], capacity=1024, width=4)
    lean = lean_forward(model)
    eager = Graphs(lean, kv, capture=False)
    captured = Graphs(lean, _static(model, [cache], capacity=1024, width=4))
    with torch.inference_mode():
        for g in (eager, captured):
            g.kv.ids[0] = ids[0, 20:24]
            g.kv.positions[0] = torch.arange(20, 24, device=device)
            g.kv.lengths[0] = 20
    want = eager.run(1, 4).clone()
    for _ in range(2):  # the capture's first run, then a replay
        got = captured.run(1, 4)
        assert torch.allclose(got, want, atol=TOL, rtol=0), f"{(got - want).abs().max()=}"
    assert captured.num_graphs == 1
    release(cache)
    model = build("llama", device, vocab_size=len(tokenizer))
    engine = PromptCache(model, tokenizer, fallback="never", prompt_lookup=4)
    engine.add_schema(REPEATS)
    with_graphs = engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).token_ids
    monkeypatch.setenv(GRAPHS_ENV, "0")
    assert engine.generate(PROMPT, max_new_tokens=24, ignore_eos=True).token_ids == with_graphs


def test_cuda_batched_graphs_equal_the_eager_batched_step(device, monkeypatch):
    _cuda_only(device)
    model = build("llama", device)
    ids = torch.randint(0, 128, (3, 40), device=device)
    lengths = [12, 30, 5]
    caches = [_prefilled(model, ids[b : b + 1], n) for b, n in enumerate(lengths)]
    eager, static = (BatchCache(model.config, kv_geometry(model), 4, 64, model.dtype, model.device) for _ in range(2))
    for batch in (eager, static):
        for b, cache in enumerate(caches):
            batch.load(b, cache)
    for t in range(3):
        toks = [int(ids[b, lengths[b] + t]) for b in range(3)]
        pos = [lengths[b] + t for b in range(3)]
        got = decode_step(model, static, toks, pos)  # graphs: CUDA
        monkeypatch.setenv(GRAPHS_ENV, "0")
        want = decode_step(model, eager, toks, pos)
        monkeypatch.delenv(GRAPHS_ENV)
        assert torch.allclose(got, want, atol=TOL, rtol=0), f"{t=} {(got - want).abs().max()=}"
