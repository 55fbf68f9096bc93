"""Chunked prefill against whole prefill: the same logits and KV when the new tokens run a chunk at
a time (tiny random-weight models, fp32: the lean Llama forward, transformers' forward over a reserved
cache, and a sliding-window model's own cache; with assembly's 4D mask and without), and the batcher
running a new request's prefill in chunks between the decode steps of a running one, with the same
greedy tokens as alone."""

from __future__ import annotations

import pytest
import torch

import rag_promptcache.engine.batcher as batcher_module
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.batcher import Batcher
from rag_promptcache.engine.prefill import Prefilling, prefill, start
from rag_promptcache.store import MemoryStore
from tests.test_batch import PROMPTS, SCHEMA
from tests.tiny import build

TOL = 1e-5  # fp32: a chunk's matmuls and softmax run over fewer rows and columns than the whole one's


def _engine(arch: str, tokenizer, recovery: str = "none") -> PromptCache:
    pc = PromptCache(build(arch, vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery=recovery)
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
def test_chunks_give_the_logits_and_kv_of_one_forward(tokenizer, arch, recovery, masked):
    pc = _engine(arch, tokenizer, recovery)
    plan = pc.plan(PROMPTS[3])  # three modules and a question
    whole = prefill(pc.model, plan, pc.relocator, pc.geometry)
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


def test_batcher_interleaves_a_new_prefill_with_the_running_decode(tokenizer, monkeypatch):
    pc = _engine("llama", tokenizer)
    alone = [pc.generate(p, max_new_tokens=n, ignore_eos=True) for p, n in ((PROMPTS[0], 40), (PROMPTS[3], 6))]
    log: list[tuple[str, int]] = []  # ("chunk", tokens) per prefill forward, ("step", rows) per decode forward
    run, step, row = Prefilling.run, batcher_module.decode_step, batcher_module.decode_row

    def logged_run(self, model, tokens=None):
        log.append(("chunk", self.num_left if tokens is None else min(tokens, self.num_left)))
        return run(self, model, tokens)

    monkeypatch.setattr(Prefilling, "run", logged_run)
    monkeypatch.setattr(batcher_module, "decode_step",
                        lambda m, b, ids, *a, **k: log.append(("step", len(ids))) or step(m, b, ids, *a, **k))
    monkeypatch.setattr(batcher_module, "decode_row", lambda *a, **k: log.append(("step", 1)) or row(*a, **k))
    with pc.scheduler(max_batch=2) as s:
        assert s.prefill_chunk == batcher_module.DEFAULT_PREFILL_CHUNK
    with Batcher(pc, max_batch=2, prefill_chunk=4) as s:
        first = s.submit(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        it = iter(first)
        next(it)  # running: the next prefill goes in chunks between its steps
        late = s.submit(PROMPTS[3], max_new_tokens=6, ignore_eos=True)
        assert late.consume().token_ids == alone[1].token_ids
        assert first.consume().token_ids == alone[0].token_ids
    plan = pc.plan(PROMPTS[0])
    assert log[0] == ("chunk", plan.num_tokens - plan.num_cached)  # nothing decoding yet: one forward
    chunks = [i for i, (kind, _) in enumerate(log) if kind == "chunk"][1:]
    num_new = sum(log[i][1] for i in chunks)
    assert len(chunks) == -(-num_new // 4) > 1 and all(log[i][1] <= 4 for i in chunks)
    # the running request steps between every two chunks of the new one
    assert all(any(kind == "step" for kind, _ in log[a + 1 : b]) for a, b in zip(chunks, chunks[1:]))
