"""The by-product probe's mechanics (research/byproduct_probe.py): a module's slice of a full prefill,
moved back to the module's own encoding position, is its plain entry when it is the prompt's first
module (it read what a plain encoding reads), and a prompt read from its own by-product entries with
recovery `none` is its full prefill; the donor of an entry is never the question being answered.
Tiny random models, fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from research.byproduct_probe import Donors, byproduct_entries, parse_setting, tempered, with_entries
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.store import MemoryStore
from tests.tiny import build

SCHEMA = """<schema name="s"><system>You are helpful. Answer from the documents.</system>
<module name="a">The quick brown fox jumps over the lazy dog near the river bank.</module>
<module name="b">Paris is the capital of France and the Seine runs through it.</module>
<module name="c">Tokyo is the capital of Japan and has great food.</module></schema>"""
PROMPT = '<prompt schema="s"><b/><a/><c/><user>What jumps?</user></prompt>'


def engine(arch: str, tokenizer) -> PromptCache:
    pc = PromptCache(build(arch, vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     fallback="never", prefix_cache_bytes=0)
    pc.add_schema(SCHEMA)
    return pc


def _logits(pc: PromptCache, plan) -> torch.Tensor:
    out = pc.prefill(dataclasses.replace(plan, sources=None))
    release(out.cache)
    return out.logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox_pct25"])
def test_a_prompts_first_module_is_its_plain_entry_and_its_own_entries_are_its_full_prefill(arch, tokenizer):
    pc = engine(arch, tokenizer)
    plan = pc.plan(PROMPT, recovery="none", misses="encode")
    entries, full_logits = byproduct_entries(pc, PROMPT)
    assert set(entries) == {"a", "b", "c"}
    for name, kv in entries.items():
        plain = plan.kvs[name]
        assert (kv.start, kv.token_ids, kv.keys.shape, kv.values.shape) == (
            plain.start, plain.token_ids, plain.keys.shape, plain.values.shape)
    first = entries["b"]  # after the instructions alone, as its plain encoding
    assert torch.allclose(first.keys, plan.kvs["b"].keys, atol=1e-5)
    assert torch.allclose(first.values, plan.kvs["b"].values, atol=1e-5)
    # the later modules read the ones before them: not their plain entries
    assert (entries["c"].values - plan.kvs["c"].values).abs().max() > 1e-3

    own = _logits(pc, with_entries(plan, entries))
    assert torch.allclose(own, full_logits, atol=1e-4), (own - full_logits).abs().max()
    assert (_logits(pc, plan) - full_logits).abs().max() > 1e-3  # plain entries are not the full prefill


def test_the_donor_is_the_first_other_question_in_the_shuffled_order():
    retrieved = [("a", "b"), ("b", "c"), ("a", "c"), ("d",)]
    donors = Donors(retrieved, seed=3)
    first = {m: next(q for q in donors.order if m in retrieved[q]) for m in "abcd"}
    for q, mods in enumerate(retrieved):
        for m in mods:
            d = donors.donor(m, q)
            if m == "d":  # retrieved by no other question: the plain entry
                assert d is None
                continue
            assert d != q and m in retrieved[d]
            assert d == first[m] or first[m] == q  # the first, unless that is the question itself
    assert sorted(m for q in range(4) for m in donors.lends(q)) == sorted("aabbccd")


def test_settings_parse_and_unknown_ones_are_refused():
    assert parse_setting("byp+last:1") == ("byp", "last:1")
    assert parse_setting("nbr:3+none") == ("nbr", "none")
    assert parse_setting("none") == ("plain", "none")
    with pytest.raises(ValueError, match="valid: RECOVERY"):
        parse_setting("nbr:2+none")


def test_a_temperature_scales_the_cached_modules_logits_alone(tokenizer):
    """T = 1 reads the stored entries unchanged; another T changes the answer's logits through the
    modules' keys only (their values, positions and tokens as stored)."""
    pc = engine("llama", tokenizer)
    plan = pc.plan(PROMPT)
    plain = _logits(pc, plan)
    same = with_entries(plan, {m: tempered(kv, 1.0) for m, kv in plan.kvs.items()})
    assert torch.equal(_logits(pc, same), plain)
    sharper = {m: tempered(kv, 0.5) for m, kv in plan.kvs.items()}
    for m, kv in sharper.items():
        assert torch.allclose(kv.keys, plan.kvs[m].keys * 2) and torch.equal(kv.values, plan.kvs[m].values)
    assert (_logits(pc, with_entries(plan, sharper)) - plain).abs().max() > 1e-4
    assert parse_setting("temp:0.9+none") == ("temp:0.9", "none")
    for bad in ("temp:0+none", "temp:x+none"):
        with pytest.raises(ValueError, match="temp:T"):
            parse_setting(bad)
