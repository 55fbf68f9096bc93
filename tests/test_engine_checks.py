"""Engine arguments and accounting a user relies on: codec= with a store, the context window, and
what `cached_tokens` counts after a miss. Tiny random-weight models with the SmolLM2 tokenizer."""

from __future__ import annotations

import pytest

from rag_promptcache.engine import PromptCache
from rag_promptcache.store import MemoryStore
from tests.tiny import build

SCHEMA = """<schema name="s">
  <module name="a">The quick brown fox jumps over the lazy dog near the river bank.</module>
  <module name="b">Paris is the capital of France, and the Seine runs through it.</module>
</schema>"""


@pytest.fixture(scope="module")
def model(tokenizer):
    return build("llama", vocab_size=len(tokenizer))  # max_position_embeddings=2048


def test_codec_with_a_store_is_refused_with_the_way_to_set_it(model, tokenizer):
    with pytest.raises(ValueError, match=r"set it on the store instead, e\.g\. MemoryStore\(codec='int8'\)"):
        PromptCache(model, tokenizer, store=MemoryStore(), codec="int8")
    own = PromptCache(model, tokenizer, codec="int8")  # no store: the engine's own MemoryStore takes it
    assert own.store.codec == "int8"
    assert PromptCache(model, tokenizer, store=MemoryStore(codec="int8")).store.codec == "int8"
    assert PromptCache(model, tokenizer).store.codec == "native"


def test_prompt_past_the_context_window_is_refused_with_the_numbers(model, tokenizer):
    pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none")
    assert pc.context_window == 2048
    text = " ".join(f"word{i}" for i in range(520))  # ~2,000 tokens
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert 1900 < n < 2048
    pc.generate(text, max_new_tokens=2048 - n)  # exactly fits
    with pytest.raises(ValueError, match=rf"prompt of {n} tokens plus max_new_tokens={2049 - n} is 2049, "
                                         r"past the model's 2048-token context window"):
        pc.generate(text, max_new_tokens=2049 - n)
    with pytest.raises(ValueError, match="2048-token context window"):
        pc.stream(text + text, max_new_tokens=1)
    assert pc.store.stats().num_entries == 0  # refused before anything was encoded or stored


def test_missed_module_tokens_count_as_computed_not_cached(model, tokenizer):
    # the store's counts alone: with the prefix cache the repeated prompt would come from the first request
    pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none", prefix_cache_bytes=0, fallback="never")
    pc.add_schema(SCHEMA)
    prompt = '<prompt schema="s"><a/><b/> Where?</prompt>'
    units = pc.schemas.compile("s", False).units
    a_b = len(units["a"].token_ids) + len(units["b"].token_ids)
    first = pc.generate(prompt, max_new_tokens=2)  # both missed: encoded in this request
    assert set(first.missed_modules) == {"a", "b"}
    second = pc.generate(prompt, max_new_tokens=2)  # both served from the store
    assert set(second.hit_modules) == {"a", "b"}
    assert second.cached_tokens - first.cached_tokens == a_b
    assert first.computed_tokens - second.computed_tokens == a_b
    assert first.cached_tokens + a_b <= first.prompt_tokens
    pc.store.delete(pc.store_keys("s", ["b"])["b"])
    third = pc.generate(prompt, max_new_tokens=2)  # one missed
    assert third.missed_modules == ("b",)
    assert third.cached_tokens == second.cached_tokens - len(units["b"].token_ids)


def test_a_fallback_policy_assigned_after_construction_is_the_one_requests_follow(model, tokenizer):
    from rag_promptcache.engine.planning.costmodel import Costs, Fallback

    pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none", fallback="always")
    pc.add_schema(SCHEMA)
    pc.encode("s")
    prompt = '<prompt schema="s"><a/><b/><user>Where is the Seine?</user></prompt>'
    assert pc.plan(prompt).path == "full"  # "always"
    before = pc.fallback
    pc.fallback = "never"
    assert pc.fallback.policy == "never" and pc.planner.config.fallback is pc.fallback
    assert pc.plan(prompt).path == "cached" and pc.generate(prompt, max_new_tokens=2).path == "cached"
    steps = pc.background.idle_steps  # the idle recalibration is the new policy's, the old one's is gone
    assert pc.fallback.recalibrate in steps and before.recalibrate not in steps
    assert pc.fallback.on_drift == pc.background.wake
    slow = Fallback("auto", lambda: Costs(fixed_s=0.0, token_s=1e-3, pair_s=0.0, cached_token_s=1.0))  # a Fallback as given
    pc.fallback = slow
    assert pc.fallback is slow and pc.generate(prompt, max_new_tokens=2).path == "full"
    with pytest.raises(ValueError, match="unknown"):
        pc.fallback = "sometimes"
    assert pc.fallback is slow  # a bad policy changes nothing
