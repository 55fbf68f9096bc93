"""Chunked prefill against whole prefill: the same logits and KV when the new tokens run a chunk at
a time (tiny random-weight models, fp32: the lean Llama forward, transformers' forward over a reserved
cache, and a sliding-window model's own cache; with assembly's 4D mask and without), and the batcher
running a new request's prefill in chunks with the decode steps of a running one (in the same forward,
`mixed_step`, or between them), with the same greedy tokens as alone."""

from __future__ import annotations

import pytest
import torch

import rag_promptcache.engine.batching.batcher as batcher_module
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.batching.batch import BatchCache, can_mix, decode_step, mixed_step
from rag_promptcache.engine.batching.batcher import Batcher
from rag_promptcache.engine.planning.prefill import Prefilling, start
from rag_promptcache.store import MemoryStore
from tests.test_batch import PROMPTS, SCHEMA
from tests.tiny import build

TOL = 1e-5  # fp32: a chunk's matmuls and softmax run over fewer rows and columns than the whole one's


def _engine(arch: str, tokenizer, recovery: str = "none", device: str = "cpu") -> PromptCache:
    # no prefix cache: these tests count the prefill's forwards, which a prefix reused from an earlier
    # request of the same prompt would shorten (tests/test_prefix_cache.py covers the two together);
    # the cached plan always (fallback="never"): they chunk its new tokens, whichever path the timed
    # cost model would pick on this machine (tests/test_fallback.py covers that choice)
    pc = PromptCache(build(arch, device, vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery=recovery,
                     prefix_cache_bytes=0, fallback="never")
    pc.add_schema(SCHEMA)
    return pc


def _kv(cache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n tokens' keys and values of every layer: [L, H, n, D] each."""
    return (torch.stack([layer.keys[0, :, :n] for layer in cache.layers]),
            torch.stack([layer.values[0, :, :n] for layer in cache.layers]))


# first_k recomputes each module's first tokens: new tokens come before cached ones, so assembly
# builds a 4D mask; last:1 recomputes the module next to the question (new tokens after all cached)
@pytest.mark.parametrize("recovery,masked", [("none", False), ("first_k:2", True), ("last:1", False)])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_chunks_give_the_logits_and_kv_of_one_forward(tokenizer, arch, recovery, masked, device):
    pc = _engine(arch, tokenizer, recovery, device)
    plan = pc.plan(PROMPTS[3])  # three modules and a question
    whole = start(pc.model, plan, pc.relocator, pc.geometry).run(pc.model)  # one forward
    total = plan.num_tokens
    for chunk in (1, 3, 16):
        todo = start(pc.model, plan, pc.relocator, pc.geometry)
        assert (todo.asm.mask is not None) == masked
        assert todo.num_new > 3, f"{todo.num_new=}: the chunks must split something"
        outs = []
        while todo.num_left:
            outs.append(todo.run(pc.model, chunk))
        assert all(o is None for o in outs[:-1]) and outs[-1] is not None
        assert len(outs) == -(-todo.num_new // chunk)
        done = outs[-1]
        diff = float((done.logits - whole.logits).abs().max())
        assert diff < TOL, f"{arch} {recovery} chunk {chunk}: {diff=}"
        assert done.next_position == whole.next_position
        for a, b in zip(_kv(done.cache, total), _kv(whole.cache, total)):
            assert float((a - b).abs().max()) < TOL


def test_a_chunk_needs_a_token_and_a_done_prefill_runs_no_more(tokenizer):
    pc = _engine("llama", tokenizer)
    todo = start(pc.model, pc.plan(PROMPTS[0]), pc.relocator, pc.geometry)
    with pytest.raises(ValueError, match="at least 1 token"):
        todo.run(pc.model, 0)
    assert todo.run(pc.model) is not None and todo.num_left == 0
    with pytest.raises(AssertionError, match="done"):
        todo.run(pc.model, 1)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Batcher(pc, prefill_chunk=0)


@pytest.mark.parametrize("recovery", ["none", "first_k:2"])
def test_a_step_carrying_a_chunk_gives_the_logits_of_both_apart(tokenizer, recovery):
    pc = _engine("llama", tokenizer, recovery)
    assert can_mix(pc.model)
    firsts = [pc.prefill(pc.plan(p)) for p in PROMPTS[:2]]
    plan = pc.plan(PROMPTS[3])
    apart, mixed = (BatchCache(pc.model.config, pc.geometry, 2, 8, pc.model.dtype, pc.model.device) for _ in "ab")
    for batch in (apart, mixed):
        for row, first in enumerate(firsts):
            batch.load(row, first.cache)
    ref, todo = (start(pc.model, plan, pc.relocator, pc.geometry) for _ in "ab")
    assert (todo.asm.mask is not None) == (recovery != "none")
    ids = [int(f.logits.argmax()) for f in firsts]
    positions = [f.next_position for f in firsts]
    while todo.num_left:  # one step per chunk of 5, the rows decoding greedily meanwhile
        rows = decode_step(pc.model, apart, ids, positions)
        last_ref = ref.run(pc.model, 5)
        chunk = todo.take(5)
        rows_mixed, (last,) = mixed_step(pc.model, mixed, ids, positions, [(todo.cache, chunk)])
        assert float((rows_mixed - rows).abs().max()) < TOL
        assert (last_ref is not None) == chunk.last
        if chunk.last:
            assert float((last - last_ref.logits).abs().max()) < TOL
        ids, positions = [int(r.argmax()) for r in rows], [p + 1 for p in positions]
    assert apart.lengths == mixed.lengths
    assert float((apart.keys - mixed.keys).abs().max()) < TOL
    for a, b in zip(_kv(todo.cache, plan.num_tokens), _kv(ref.cache, plan.num_tokens)):
        assert float((a - b).abs().max()) < TOL


# llama: the chunks ride in the decode steps (mixed_step); qwen2 (no lean forward): they run between them
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batcher_interleaves_a_new_prefill_with_the_running_decode(tokenizer, monkeypatch, arch, device):
    pc = _engine(arch, tokenizer, device=device)
    alone = [pc.generate(p, max_new_tokens=n, ignore_eos=True) for p, n in ((PROMPTS[0], 40), (PROMPTS[3], 6))]
    # ("chunk", tokens) per prefill forward, ("step", rows) per decode forward, ("mixed", tokens) per both
    log: list[tuple[str, int]] = []
    run, step, row, mixed = Prefilling.run, batcher_module.decode_step, batcher_module.decode_row, batcher_module.mixed_step

    def logged_run(self, model, tokens=None):
        log.append(("chunk", self.num_left if tokens is None else min(tokens, self.num_left)))
        return run(self, model, tokens)

    monkeypatch.setattr(Prefilling, "run", logged_run)
    monkeypatch.setattr(batcher_module, "decode_step",
                        lambda m, b, ids, *a, **k: log.append(("step", len(ids))) or step(m, b, ids, *a, **k))
    monkeypatch.setattr(batcher_module, "decode_row", lambda *a, **k: log.append(("step", 1)) or row(*a, **k))
    monkeypatch.setattr(batcher_module, "mixed_step",
                        lambda m, b, i, p, todo: log.append(("mixed", todo[0][1].ids.shape[1])) or mixed(m, b, i, p, todo))
    with pc.scheduler(max_batch=2) as s:
        assert s.prefill_chunk == batcher_module.DEFAULT_PREFILL_CHUNK
    with Batcher(pc, max_batch=2, prefill_chunk=4) as s:
        first = s.submit(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        it = iter(first)
        next(it)  # running: the next prefill goes in chunks with or between its steps
        late = s.submit(PROMPTS[3], max_new_tokens=6, ignore_eos=True)
        assert late.consume().token_ids == alone[1].token_ids
        assert first.consume().token_ids == alone[0].token_ids
    plan = pc.plan(PROMPTS[0])
    assert log[0] == ("chunk", plan.num_tokens - plan.num_cached)  # nothing decoding yet: one forward
    late_plan = pc.plan(PROMPTS[3])
    num_new = late_plan.num_tokens - late_plan.num_cached
    kind = "mixed" if arch == "llama" else "chunk"
    assert all(k != ("chunk" if arch == "llama" else "mixed") for k, _ in log[1:])
    chunks = [i for i, (k, _) in enumerate(log[1:], 1) if k == kind]
    assert len(chunks) == -(-num_new // 4) > 1 and all(log[i][1] <= 4 for i in chunks)
    assert sum(log[i][1] for i in chunks) == num_new
    if arch == "qwen2":  # the running request steps between every two chunks of the new one
        assert all(any(k == "step" for k, _ in log[a + 1 : b]) for a, b in zip(chunks, chunks[1:]))


def test_a_step_carrying_a_chunk_reports_it_with_its_decode_rows_to_the_pace(tokenizer):
    """The cost model's pace (engine/planning/costmodel.py) hears of every prefill forward: the chunks that
    ride in a decode step come with the rows that step carried, each by the KV it attended to."""
    pc = _engine("llama", tokenizer)
    heard: list[tuple[int, int, tuple[int, ...]]] = []
    ran = pc.fallback.ran
    pc.fallback.ran = lambda new, context, seconds, rows: heard.append((new, context, tuple(rows))) or ran(
        new, context, seconds, rows)
    with Batcher(pc, max_batch=2, prefill_chunk=4) as s:
        first = s.submit(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        it = iter(first)
        next(it)  # running: the next prefill rides in its steps
        late = s.submit(PROMPTS[3], max_new_tokens=6, ignore_eos=True)
        late.consume()
        first.consume()
    plan, late_plan = pc.plan(PROMPTS[0]), pc.plan(PROMPTS[3])
    assert heard[0] == (plan.num_tokens - plan.num_cached, plan.num_cached, ())  # alone: one whole forward
    carried = heard[1:]
    assert sum(n for n, _, _ in carried) == late_plan.num_tokens - late_plan.num_cached and len(carried) > 1
    done = 0
    for n, context, rows in carried:  # each chunk against what the cache held, beside the running row
        assert context == late_plan.num_cached + done and len(rows) == 1, carried
        done += n
    lengths = [rows[0] for _, _, rows in carried]  # the row's KV grows by one token a step
    assert lengths == list(range(lengths[0], lengths[0] + len(lengths))) and lengths[0] >= plan.num_tokens
