"""Encoding modes and quality recovery against full prefill: 100% recompute is full prefill, 0% is
`none`, budgets in between are monotone on a fixed example, and bad parameters are refused."""

from __future__ import annotations

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.engine.planning.recovery import Recovery
from rag_promptcache.store import MemoryStore
from tests.tiny import build

SCHEMA = """<schema name="s"><system>You are helpful. Answer from the documents.</system>
<module name="a">The quick brown fox jumps over the lazy dog near the river bank.</module>
<module name="b">Paris is the capital of France and the Seine runs through it.</module>
<module name="c">Tokyo is the capital of Japan and has great food.</module></schema>"""
PROMPT = '<prompt schema="s"><b/><a/><c/><user>What jumps?</user></prompt>'


def engine(arch, tokenizer, device="cpu", **kw) -> PromptCache:
    pc = PromptCache(build(arch, device, vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(),
                     **{"recovery": "none", "fallback": "never", **kw})
    pc.add_schema(SCHEMA)
    return pc


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gpt_neox_pct25"])
@pytest.mark.parametrize("mode", ["isolated", "shared_prefix"])
def test_full_recompute_is_full_prefill_and_zero_is_none(arch, mode, tokenizer, device):
    pc = engine(arch, tokenizer, device, mode=mode)
    none = pc.compare(PROMPT, recovery="none")
    assert none.max_abs_logit_diff > 1e-3  # there is a gap to close
    for everything in ("selective:1.0", "first_k:1000"):
        assert pc.compare(PROMPT, recovery=everything).max_abs_logit_diff <= 1e-3, everything
    for nothing in ("selective:0", "first_k:0"):
        assert pc.compare(PROMPT, recovery=nothing).max_abs_logit_diff == pytest.approx(none.max_abs_logit_diff)


@pytest.mark.parametrize("kind,budgets", [("selective", [0, 0.1, 0.25, 0.5, 1.0]), ("first_k", [0, 1, 4, 16])])
def test_budgets_are_monotone(kind, budgets, tokenizer):
    pc = engine("llama", tokenizer)
    errors, cached = [], []
    for b in budgets:
        errors.append(pc.compare(PROMPT, recovery=f"{kind}:{b}").max_abs_logit_diff)
        cached.append(pc.plan(PROMPT, recovery=f"{kind}:{b}").num_cached)
    assert errors == sorted(errors, reverse=True), errors
    assert cached == sorted(cached, reverse=True) and cached[0] > cached[-1], cached


def test_shared_prefix_beats_isolated_and_keys_differ(tokenizer):
    iso, shared = engine("llama", tokenizer, mode="isolated"), engine("llama", tokenizer, mode="shared_prefix")
    assert shared.compare(PROMPT).kl < iso.compare(PROMPT).kl
    # a module encoded after the system text is a different entry from the same module alone
    k_iso = iso.plan(PROMPT).kvs["a"]
    k_shared = shared.plan(PROMPT).kvs["a"]
    assert k_iso.mode == "isolated" and k_shared.mode == "shared_prefix"
    assert (k_iso.values - k_shared.values).abs().max() > 1e-4


def test_generation_uses_recovery_and_counts_recomputed_tokens(tokenizer):
    pc = engine("llama", tokenizer, recovery="first_k:4")
    pc.encode("s")
    base = pc.generate(PROMPT, max_new_tokens=2, recovery="none")
    rec = pc.generate(PROMPT, max_new_tokens=2)  # the engine default, first_k:4
    assert rec.cached_tokens == base.cached_tokens - 3 * 4  # the 3 modules; the system text opens the sequence
    assert rec.computed_tokens > base.computed_tokens


@pytest.mark.parametrize("recovery", ["none", "last:2", "first_k:4", "selective:0.5", "last:3"])
def test_every_prompt_token_counts_once_as_cached_or_computed(recovery, tokenizer):
    # issue 25 item 12: a missed module that recovery also recomputes was counted as computed twice
    pc = engine("llama", tokenizer, recovery=recovery)
    missed = pc.generate(PROMPT, max_new_tokens=2)  # nothing stored yet: every module missed
    assert set(missed.missed_modules) == {"a", "b", "c"} and missed.cached_tokens == 0
    assert missed.computed_tokens == missed.prompt_tokens
    hit = pc.generate(PROMPT, max_new_tokens=2)
    assert set(hit.hit_modules) == {"a", "b", "c"}
    assert hit.cached_tokens + hit.computed_tokens == hit.prompt_tokens == missed.prompt_tokens


@pytest.mark.parametrize("spec,match", [
    ("selective:1.5", r"fraction r in \[0, 1\]"), ("selective:-0.1", r"fraction r in \[0, 1\]"),
    ("first_k:-1", "k >= 0"), ("first_k:2.5", "whole number"), ("blend:0.1", "valid: none, first_k, selective"),
    ("selective:abc", "bad recovery"), ("selective:0.2@-1", "layer must be >= 0"),
    ("none@k>=3", "none recovers nothing"), ("last:1@k>=x", "bad recovery"), ("last:1@k>=-1", "N >= 0"),
])
def test_bad_recovery_parameters(spec, match):
    with pytest.raises(ValueError, match=match):
        Recovery.parse(spec)


def test_recovery_round_trips_and_bad_layer(tokenizer):
    for spec in ("none", "first_k:8", "selective:0.15", "selective:0.15@3", "last:1@k>=5", "selective:0.15@3@k>=4"):
        assert str(Recovery.parse(spec)) == spec
    pc = engine("llama", tokenizer)
    with pytest.raises(ValueError, match="past the model's 2 layers"):
        pc.compare(PROMPT, recovery="selective:0.2@5")
    with pytest.raises(ValueError, match="valid: isolated, shared_prefix"):
        PromptCache(pc.model, tokenizer, mode="shared")


def test_a_recovery_from_k_modules_on_reads_a_smaller_prompt_as_stored(tokenizer):
    pc = engine("llama", tokenizer)
    pc.encode("s")

    def planned(spec: str):
        plan = pc.plan(PROMPT, recovery=spec, fallback=False)
        out = pc.prefill(plan)
        release(out.cache)
        return plan, out.logits

    (none, none_logits), (last, last_logits) = planned("none"), planned("last:1")
    below, below_logits = planned("last:1@k>=4")  # the prompt holds 3 modules
    at, at_logits = planned("last:1@k>=3")
    assert last.num_cached < none.num_cached
    assert below.pieces == none.pieces and torch.equal(below_logits, none_logits)
    assert at.pieces == last.pieces and torch.equal(at_logits, last_logits)
    assert pc.generate(PROMPT, max_new_tokens=1, recovery="last:1@k>=4").cached_tokens == none.num_cached


def test_the_default_is_shared_prefix_with_last_3(tokenizer):
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore())
    assert (pc.mode, str(pc.recovery)) == ("shared_prefix", "last:3")
