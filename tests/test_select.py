"""Question-aware selection (engine/planning/select.py): the budget is respected, the exact first module and the
schema text are never chosen, `near` and `sinks` pick where they say, sentences are whole, and the
question's attention is read over the real cached tokens of a tiny model."""

from __future__ import annotations

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning.select import Selection, Stale, choose, question_mass, stale_tokens
from rag_promptcache.store import MemoryStore
from tests.test_recovery import PROMPT, SCHEMA
from tests.tiny import build

# three modules of 5 tokens after 2 root tokens; module "a" plays the exact first module
STALE = Stale(seq=list(range(17)), unit=["<root>"] * 2 + ["a"] * 5 + ["b"] * 5 + ["c"] * 5,
              choosable=[False] * 7 + [True] * 10, token_ids=[1, 2] + [5, 5, 9, 5, 9] * 3)


def test_budget_and_never_the_exact_or_root():
    mass = torch.arange(17, dtype=torch.float32).flip(0)  # the root and "a" score highest
    got = choose(STALE, mass, Selection(0.3, window=0))
    assert len(got) == 3 and got <= set(range(7, 17))
    assert got == {7, 8, 9}  # the best-scored choosable tokens


def test_window_stays_in_its_module_and_near_restricts():
    mass = torch.zeros(17)
    mass[11] = 1.0  # the last token of "b"
    assert choose(STALE, mass, Selection(0.2, window=1)) == {10, 11}  # 12 is "c": not a neighbour
    only_c = choose(STALE, mass, Selection(0.4, near=1, window=0))
    assert only_c <= set(range(12, 17)) and len(only_c) == 2  # 40% of c's 5 tokens


def test_sinks_and_sentences():
    mass = torch.zeros(17)
    assert choose(STALE, mass, Selection(0.0, sinks=2)) == {7, 8, 12, 13}
    mass[15] = 1.0  # inside c's second sentence [15, 16]: token 9 ends a sentence
    assert choose(STALE, mass, Selection(0.2, shape="sentences"), frozenset({9})) == {15, 16}


def test_bad_selection_is_refused():
    with pytest.raises(ValueError, match="valid: tokens, sentences"):
        Selection(0.1, shape="words")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        Selection(1.5)


def test_question_mass_covers_the_cached_tokens(tokenizer):
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     fallback="never")
    pc.add_schema(SCHEMA)
    plan = pc.plan(PROMPT, recovery="none")
    mass = question_mass(plan.pieces, plan.kvs, pc.model, pc.relocator, pc.geometry, (0, 1))
    stale = stale_tokens(plan.pieces, plan.kvs)
    assert mass.shape == (len(stale.seq),) and (mass >= 0).all() and float(mass.sum()) > 0
    with pytest.raises(ValueError, match="past the model"):
        question_mass(plan.pieces, plan.kvs, pc.model, pc.relocator, pc.geometry, (99,))


def test_whole_takes_the_nearest_module_and_spends_the_budget_elsewhere():
    mass = torch.zeros(17)
    mass[8] = 1.0
    assert choose(STALE, mass, Selection(0.1, whole=1, window=0)) == {8, 12, 13, 14, 15, 16}


def test_question_recovery_recomputes_the_nearest_module_and_its_budget(tokenizer):
    """`question:R` (engine/planning/recovery.py): the stale module nearest the question whole, then R of the stale
    tokens from the other modules;
    R = 1 is every stale token, so its logits match full prefill's."""
    from rag_promptcache.engine.planning.recovery import Recovery

    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     fallback="never")
    pc.add_schema(SCHEMA)
    base = pc.plan(PROMPT, recovery="none")
    stale = stale_tokens(base.pieces, base.kvs)
    per = {u: stale.unit.count(u) for u, ok in zip(stale.unit, stale.choosable) if ok}
    nearest = list(per)[-1]
    fresh = lambda plan: sum(len(p.token_ids) for p in plan.pieces if not p.cached)  # noqa: E731
    assert fresh(pc.plan(PROMPT, recovery="question:0@1")) - fresh(base) == per[nearest]
    others = sum(per.values()) - per[nearest]
    half = pc.plan(PROMPT, recovery="question:0.5@1")  # R is a share of all stale tokens, spent outside the nearest
    assert fresh(half) - fresh(base) == per[nearest] + min(others, round(0.5 * sum(per.values())))
    assert pc.compare(PROMPT, recovery="question:1@1").max_abs_logit_diff <= 1e-3
    assert pc.compare(PROMPT, recovery="question:1@1").max_abs_logit_diff < pc.compare(PROMPT, recovery="none").max_abs_logit_diff
    assert str(Recovery.parse("question:0.05")) == "question:0.05" and Recovery.parse("question:0.05@4").layer == 4
    with pytest.raises(ValueError, match="past the model's 2 layers"):
        pc.plan(PROMPT, recovery="question:0.1")  # the default layer 8 on a 2-layer model
    with pytest.raises(ValueError, match=r"question needs a fraction r in \[0, 1\]"):
        Recovery.parse("question:2")
