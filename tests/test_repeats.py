"""Exact repeats (engine/prefix/prefix_cache.py): a request the prefix cache holds whole, prompt KV and the
logits after it, runs no prefill forward and answers as the first one did, in fp32 and bf16, through
the engine's loop and the batcher; and the cost model counts what the prefix cache holds."""

from __future__ import annotations

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning import prefill
from rag_promptcache.engine.planning.costmodel import Costs, Fallback
from rag_promptcache.store import MemoryStore
from tests.test_prefix_cache import CHAT_SCHEMA, chat
from tests.tiny import build

GREEDY = dict(max_new_tokens=8, ignore_eos=True)


def tiny_engine(tokenizer, dtype=torch.float32, **kwargs) -> PromptCache:
    model = build("llama", vocab_size=len(tokenizer)).to(dtype)
    pc = PromptCache(model, tokenizer, store=MemoryStore(), **{"recovery": "last:2", **kwargs})
    pc.add_schema(CHAT_SCHEMA)
    return pc


@pytest.fixture
def prefills(monkeypatch) -> list[int]:
    """The new tokens of every prefill forward that runs (engine/planning/prefill.py), wrapped, not replaced."""
    seen: list[int] = []
    real = prefill.forward_last

    def counted(model, ids, *args, **kwargs):
        seen.append(ids.shape[-1])
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(prefill, "forward_last", counted)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_repeat_runs_no_prefill_and_answers_as_the_first(tokenizer, dtype, prefills):
    pc = tiny_engine(tokenizer, dtype, fallback="never")
    prompt = chat(["a", "b", "c"], [("user", "Where is Paris?")])
    first = pc.generate(prompt, **GREEDY)
    assert len(prefills) == 1
    again = pc.generate(prompt, **GREEDY)
    assert again.token_ids == first.token_ids and len(prefills) == 1  # no prefill forward ran
    assert again.num_prefix_tokens == again.prompt_tokens == again.cached_tokens and again.computed_tokens == 0
    assert pc.prefix_cache.num_repeats == 1
    other = pc.generate(chat(["a", "b", "c"], [("user", "Where is Rome?")]), **GREEDY)
    assert len(prefills) == 2 and other.num_prefix_tokens < other.prompt_tokens


@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_the_batcher_answers_a_repeat_without_a_prefill(tokenizer, prefill_chunk, prefills):
    pc = tiny_engine(tokenizer, torch.bfloat16, fallback="never")
    prompt = chat(["b", "c"], [("user", "And Fuji?")])
    with pc.scheduler(max_batch=2, prefill_chunk=prefill_chunk) as batcher:
        first = batcher.submit(prompt, **GREEDY).consume()
        other = batcher.submit(chat(["a"], [("user", "Where?")]), max_new_tokens=30, ignore_eos=True)
        again = batcher.submit(prompt, **GREEDY).consume()  # joins while `other` decodes
        other.consume()
    assert again.token_ids == first.token_ids and again.num_prefix_tokens == again.prompt_tokens
    assert pc.prefix_cache.num_repeats == 1
    if prefill_chunk is None:  # whole prefills run here; chunks ride in the decode step's forward
        assert len(prefills) == 2


def test_a_repeat_needs_the_whole_prompt_and_other_prompts_are_not_repeats(tokenizer):
    pc = tiny_engine(tokenizer, fallback="never")
    prompt = chat(["a"], [("user", "Where?")])
    first = pc.generate(prompt, **GREEDY)
    longer = pc.generate(chat(["a"], [("user", "Where?"), ("assistant", first.text), ("user", "Why?")]), **GREEDY)
    assert 0 < longer.num_prefix_tokens < longer.prompt_tokens and pc.prefix_cache.num_repeats == 0
    pc.prefix_cache.tree.evict()  # the KV gone, the kept logits alone make no repeat
    assert pc.generate(prompt, **GREEDY).num_prefix_tokens == 0 and pc.prefix_cache.num_repeats == 0


def test_the_cost_model_counts_what_the_prefix_cache_holds():
    """A follow-up whose history the full path computed before: assembling 900 stored tokens and computing
    100 loses to a full prefill that takes 990 from the prefix cache and computes 10."""
    costs = Costs(fixed_s=1e-3, token_s=1e-4, pair_s=0.0, cached_token_s=1e-6, cached_fixed_s=2e-3)
    auto = Fallback("auto", lambda: costs)
    assert not auto.use_full(1000, 900)
    assert auto.use_full(1000, 900, num_reused_full=990)
    assert not auto.use_full(1000, 900, num_new=0, num_reused_full=990)  # a repeat of the cached plan


def test_the_planner_asks_the_prefix_cache(tokenizer):
    costs = Costs(fixed_s=1e-3, token_s=1e-4, pair_s=0.0, cached_token_s=1e-6, cached_fixed_s=2e-3)
    always, auto = tiny_engine(tokenizer, fallback="always"), None
    prompt = chat(["a", "b", "c", "d"], [("user", "Where is Paris?")])
    always.generate(prompt, **GREEDY)  # the full path's KV of this prompt, kept
    auto = PromptCache(always.model, tokenizer, store=always.store, recovery="none", fallback=Fallback("auto", lambda: costs))
    auto.add_schema(CHAT_SCHEMA)
    assert auto.plan(prompt).path == "cached"
    auto.prefix_cache = always.prefix_cache  # the same model: the full path's prefix now counts
    assert auto.plan(prompt).path == "full"
    assert auto.generate(prompt, **GREEDY).num_prefix_tokens == auto.plan(prompt).num_tokens
