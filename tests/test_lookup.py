"""Prompt lookup decoding: the drafter's bookkeeping (pure Python, exact drafts), and the engine's
answers with it against the same engine without it, token for token (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from rag_promptcache.engine import PromptCache, Sampling
from rag_promptcache.engine.kv.assemble import reserved_cache
from rag_promptcache.engine.decoding.decode import decode
from rag_promptcache.engine.compute.runner import forward_last
from rag_promptcache.engine.decoding.state import DecodeState, DecodeStats
from rag_promptcache.engine.decoding.lookup import DEFAULT_LOOKUP, ENV, DraftBudget, NgramDrafter
from rag_promptcache.model.positions import kv_geometry
from rag_promptcache.store import MemoryStore
from tests.test_batch import DOCS
from tests.tiny import build

# -- the drafter ----------------------------------------------------------------------------------


def test_draft_continues_the_latest_earlier_occurrence_of_the_tail():
    d = NgramDrafter([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 2, 3], min_ngram=2, max_ngram=3)
    # tail (2, 3) occurred twice before: the latest one was followed by 7, 8, ...
    assert d.draft(3) == [7, 8, 0]
    assert d.draft(1) == [7]


def test_longer_ngrams_win_over_shorter_ones():
    # (2, 3) last continued with 9; the longer tail (1, 2, 3) only ever continued with 4
    d = NgramDrafter([1, 2, 3, 4, 5, 6, 2, 3, 9, 1, 2, 3], min_ngram=2, max_ngram=3)
    assert d.draft(2) == [4, 5]
    d = NgramDrafter([1, 2, 3, 4, 5, 6, 2, 3, 9, 1, 2, 3], min_ngram=2, max_ngram=2)
    assert d.draft(2) == [9, 1]


def test_no_match_no_draft_and_the_tail_never_matches_itself():
    assert NgramDrafter([1, 2, 3, 4]).draft(5) == []
    assert NgramDrafter([]).draft(5) == []
    assert NgramDrafter([7]).draft(5) == []
    d = NgramDrafter([5, 6, 5, 6])  # (5, 6) ended at index 1, followed by 5: its own tail is not a match
    assert d.draft(4) == [5, 6]


def test_extend_indexes_the_answer_as_it_grows():
    d = NgramDrafter([10, 11, 12, 13], min_ngram=1, max_ngram=2)
    assert d.draft(2) == []
    d.extend([11])  # tail (11,) matches the prompt's 11, followed by 12, 13
    assert d.draft(2) == [12, 13]
    d.extend([12, 99])
    d.extend([12])  # (99, 12) is new, (12,) last continued with 99 (in the answer, the latest)
    assert d.draft(3) == [99, 12]
    assert len(d.tokens) == 8


def test_bad_ngram_bounds_are_a_clear_error():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter([], min_ngram=0)
    with pytest.raises(ValueError, match="max_ngram"):
        NgramDrafter([], min_ngram=3, max_ngram=2)


def test_draft_budget_drafts_what_pays():
    kept = DraftBudget(8)
    assert 0 < kept.size() < 8  # the prior alone: a few tokens
    for _ in range(20):  # every drafted token kept
        kept.update(kept.size(), kept.size())
    assert kept.size() == 8
    useless = DraftBudget(8)
    for _ in range(30):  # nothing kept: no drafts, but every PROBE-th forward tries one token
        useless.update(useless.size(), 0)
    sizes = [useless.size() for _ in range(2 * DraftBudget.PROBE)]
    assert sizes.count(1) == 2 and sizes.count(0) == 2 * DraftBudget.PROBE - 2
    half = [DraftBudget(8, kappa=k) for k in (0.05, 1.0)]
    for b in half:  # the first drafted token kept half the time
        for i in range(20):
            b.update(2, i % 2)
    assert half[0].size() >= 1 and half[1].size() == 0  # a costly row is not worth a coin flip
    assert DraftBudget(0).size() == 0


# -- the engine -----------------------------------------------------------------------------------

SCHEMA = """<schema name="s">
  <module name="a">The river Aldern runs north through Brisk and Corran, and the river Aldern floods in May.</module>
  <module name="b">The river Belt runs south through Dunmore, and the river Belt never floods.</module>
</schema>"""
PROMPT = '<prompt schema="s"><a/><b/>Where does the river Aldern run, and when does it flood?</prompt>'


def _decode(model, cache, prompt: list[int], lookup: int, n: int) -> tuple[list[int], DecodeStats]:
    logits = forward_last(model, torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
    state = DecodeState(Sampling(max_new_tokens=n), start=len(prompt), eos_ids=frozenset(), history=prompt, lookup=lookup)
    state.advance(logits[None])
    for _ in decode(model, cache, state):  # no text: the tokens are the state's
        pass
    return state.tokens, state.stats


# llama: the lean forward over the reserved cache; qwen2, phi3, gemma2: transformers' forward over it,
# or over transformers' own DynamicCache, whose sliding-window layers (gemma2) cannot be cropped: no
# drafts there, the plain loop. A 16-token vocabulary: a random model repeats itself, so the drafts
# are both accepted and rejected; gemma3_window's 16-token window is far shorter than the answer
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3_partial", "gemma2", "gemma3_window"])
@pytest.mark.parametrize("reserved", [True, False])
def test_decode_with_lookup_is_greedy_decoding_token_for_token(arch, reserved):
    model = build(arch, vocab_size=16)
    prompt = [int(t) for t in torch.randint(0, 16, (24,), generator=torch.Generator().manual_seed(1))]

    def cache():
        made = reserved_cache(model.config, kv_geometry(model), 128, model.dtype, model.device) if reserved else None
        return DynamicCache(config=model.config) if made is None else made[0]

    plain, plain_stats = _decode(model, cache(), prompt, 0, 64)
    fast, stats = _decode(model, cache(), prompt, 4, 64)
    assert fast == plain and len(fast) == 64
    assert plain_stats.num_forwards == 63 and plain_stats.num_drafted == 0
    if arch.startswith("gemma") and not reserved:
        assert stats.num_forwards == 63 and stats.num_drafted == 0
    else:
        # gemma2's drafts on this prompt are all accepted: nothing to reject there
        assert 0 < stats.num_accepted < stats.num_drafted or arch == "gemma2" and stats.num_accepted > 0, stats
        # every forward gives its accepted tokens and one more, unless the budget ends inside a draft
        assert stats.num_forwards + stats.num_accepted in (63, 64)


def test_greedy_answer_is_the_same_with_and_without_lookup(tokenizer):
    model = build("llama", vocab_size=len(tokenizer))
    results = {}
    for lookup in (0, 4):
        pc = PromptCache(model, tokenizer, store=MemoryStore(), prompt_lookup=lookup)
        pc.add_schema(SCHEMA)
        results[lookup] = pc.generate(PROMPT, max_new_tokens=24, ignore_eos=True)
    assert results[4].token_ids == results[0].token_ids and results[0].num_decode_forwards == 23


def test_stop_strings_eos_and_the_token_budget_hold_with_lookup(tokenizer):
    model = build("llama", vocab_size=len(tokenizer))
    pc = PromptCache(model, tokenizer, store=MemoryStore(), prompt_lookup=8)
    pc.add_schema(SCHEMA)
    full = pc.generate(PROMPT, max_new_tokens=40, ignore_eos=True)
    for n in (1, 2, 7, 13):  # a budget that ends inside an accepted draft is still exact
        assert pc.generate(PROMPT, max_new_tokens=n, ignore_eos=True).token_ids == full.token_ids[:n]
    stop = tokenizer.decode(full.token_ids[20:23])
    stopped = pc.generate(PROMPT, max_new_tokens=40, ignore_eos=True, stop=[stop])
    assert stopped.finish_reason == "stop" and full.text.startswith(stopped.text) and stop not in stopped.text
    pc.eos_ids = frozenset({full.token_ids[9]})  # as if that token were EOS: the answer ends there
    ended = pc.generate(PROMPT, max_new_tokens=40)
    first = full.token_ids.index(full.token_ids[9])
    assert ended.finish_reason == "eos" and ended.token_ids == full.token_ids[: first + 1]


def test_sampling_and_bad_lookup_values(tokenizer, monkeypatch):
    model = build("llama", vocab_size=len(tokenizer))
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="prompt_lookup must be an integer >= 0"):
            PromptCache(model, tokenizer, prompt_lookup=bad)
    assert PromptCache(model, tokenizer).prompt_lookup == DEFAULT_LOOKUP
    monkeypatch.setenv(ENV, "0")
    assert PromptCache(model, tokenizer).prompt_lookup == 0
    assert PromptCache(model, tokenizer, prompt_lookup=3).prompt_lookup == 3  # the argument wins
    monkeypatch.setenv(ENV, "lots")
    with pytest.raises(ValueError, match=f"{ENV} must be .* got .lots."):
        PromptCache(model, tokenizer)
    monkeypatch.delenv(ENV)
    pc = PromptCache(model, tokenizer, store=MemoryStore(), prompt_lookup=8)
    pc.add_schema(SCHEMA)
    sampled = pc.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    assert sampled.num_decode_forwards == 11  # lookup is greedy only: sampling runs one token per forward
    assert sampled.token_ids == pc.generate(PROMPT, max_new_tokens=12, temperature=0.8, seed=3, ignore_eos=True).token_ids


# an answer that copies its document: prompt lookup drafts it
COPY = ('<prompt schema="doc"><eiffel/><user>When was the Eiffel Tower completed, and how tall is it? '
        'Answer with the sentence from the document.</user></prompt>')


@pytest.mark.smollm
def test_smollm2_answer_is_the_same_with_and_without_lookup(smollm):
    model, tokenizer = smollm
    answers = {}
    for lookup in (0, 8):
        pc = PromptCache(model, tokenizer, store=MemoryStore(), prompt_lookup=lookup)
        pc.add_schema(DOCS)
        answers[lookup] = pc.generate(COPY, max_new_tokens=40)
    assert answers[8].token_ids == answers[0].token_ids and "1889" in answers[8].text
    assert answers[8].num_decode_forwards < answers[0].num_decode_forwards  # it copies the document


@pytest.mark.smollm
def test_smollm2_a_request_alone_in_the_scheduler_uses_lookup_and_others_join_it(smollm):
    model, tokenizer = smollm
    pc = PromptCache(model, tokenizer, store=MemoryStore())
    pc.add_schema(DOCS)
    other = '<prompt schema="doc"><moon/><user>Who walked on the Moon first?</user></prompt>'
    alone = pc.generate(COPY, max_new_tokens=40, ignore_eos=True)
    other_alone = pc.generate(other, max_new_tokens=12, ignore_eos=True)
    with pc.scheduler(max_batch=4) as s:
        lone = s.submit(COPY, max_new_tokens=40, ignore_eos=True).consume()
        assert lone.token_ids == alone.token_ids and lone.num_decode_forwards < 39  # drafts were accepted
        first = s.submit(COPY, max_new_tokens=40, ignore_eos=True)
        it = iter(first)
        for _ in range(3):  # running alone: prompt lookup checks, then another request joins the batch
            next(it)
        late = s.submit(other, max_new_tokens=12, ignore_eos=True)
        assert late.consume().token_ids == other_alone.token_ids
        assert first.consume().token_ids == alone.token_ids
    sampled = pc.scheduler(max_batch=2)
    with sampled:  # sampling: one token per forward, alone or not
        r = sampled.submit(COPY, max_new_tokens=10, temperature=0.7, seed=1, ignore_eos=True).consume()
    assert r.num_decode_forwards == 9
