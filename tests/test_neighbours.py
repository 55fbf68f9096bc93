"""Neighbour-aware module encoding (`ast.Schema.neighbours`): a module encoded after other modules' text,
only its own KV kept and moved back to its usual position, is exactly that slice of a full forward; the
miss path and the ingest path store the same KV under the same key; a module without neighbours is the
entry it always was. Tiny random models, fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning.plan import uncached
from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.pml.parser import parse_schema
from rag_promptcache.store import MemoryStore
from rag_promptcache.store.base import module_key
from tests.tiny import build

SCHEMA = """<schema name="s"><system>You are helpful. Answer from the documents.</system>
<module name="a">The quick brown fox jumps over the lazy dog near the river bank.</module>
<module name="b">Paris is the capital of France and the Seine runs through it.</module>
<module name="c">Tokyo is the capital of Japan and has great food.</module></schema>"""
PROMPT = '<prompt schema="s"><b/><c/><a/><user>What jumps?</user></prompt>'
NEIGHBOURS = {"a": ("c", "b")}  # b, the most similar, right before a


def schema(neighbours=None):
    parsed = parse_schema(SCHEMA)
    return dataclasses.replace(parsed, neighbours=dict(NEIGHBOURS if neighbours is None else neighbours))


def engine(model, tokenizer, mode="shared_prefix", neighbours=None) -> PromptCache:
    pc = PromptCache(model, tokenizer, store=MemoryStore(), mode=mode, recovery="none", fallback="never")
    pc.add_schema(schema(neighbours))
    return pc


@pytest.fixture(scope="module")
def model(tokenizer):
    return build("llama", vocab_size=len(tokenizer))


def _units(pc: PromptCache):
    chat, default = pc.schemas.chat_of("s")
    return pc.schemas.compile("s", chat, default).units


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox_pct25"])
@pytest.mark.parametrize("mode", ["shared_prefix", "isolated"])
@torch.inference_mode()
def test_a_module_after_neighbours_is_the_full_forwards_slice_moved_back(arch, mode, tokenizer):
    model = build(arch, vocab_size=len(tokenizer))
    pc = engine(model, tokenizer, mode)
    units = _units(pc)
    a = units["a"]
    before = units["c"].token_ids + units["b"].token_ids
    assert a.neighbour_ids == before
    context = a.context_ids if mode == "shared_prefix" else ()
    ids = list(context) + list(before) + list(a.token_ids)
    first = a.encode_start - len(context)
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(first, first + len(ids))[None], use_cache=True)
    n = len(a.token_ids)
    cache = out.past_key_values
    keys = torch.stack([cache.layers[i].keys[0, :, -n:] for i in range(len(cache.layers))])
    values = torch.stack([cache.layers[i].values[0, :, -n:] for i in range(len(cache.layers))])
    keys = pc.relocator.rotate(keys, torch.full((n,), -len(before)))

    kv = pc.plan(PROMPT).kvs["a"]  # a miss: the planner's encoding
    assert kv.start == a.encode_start and kv.token_ids == a.token_ids
    assert (kv.keys - keys).abs().max() < 1e-3 and (kv.values - values).abs().max() < 1e-3
    # and it read the neighbours: not the module encoded without them
    alone = engine(model, tokenizer, mode, neighbours={}).plan(PROMPT).kvs["a"]
    assert (alone.values - kv.values).abs().max() > 1e-3


def test_keys_differ_only_for_modules_with_neighbours(model, tokenizer):
    with_, without = engine(model, tokenizer), engine(model, tokenizer, neighbours={})
    k_with = with_.store_keys("s", ["a", "b", "c"])
    k_without = without.store_keys("s", ["a", "b", "c"])
    assert k_with["a"] != k_without["a"]
    assert k_with["b"] == k_without["b"] and k_with["c"] == k_without["c"]
    # a module without neighbours keeps the address stores made before neighbours existed hold
    b = _units(without)["b"]
    assert k_without["b"] == module_key(without.fingerprint, "shared_prefix", b.token_ids, b.encode_start, b.context_ids)
    kv_with, kv_without = with_.plan(PROMPT).kvs, without.plan(PROMPT).kvs
    for name in ("b", "c"):
        assert torch.equal(kv_with[name].keys, kv_without[name].keys)
        assert torch.equal(kv_with[name].values, kv_without[name].values)
    # other neighbours, or the same in another order, are another entry
    other = engine(model, tokenizer, neighbours={"a": ("b", "c")}).store_keys("s", ["a"])["a"]
    assert other not in (k_with["a"], k_without["a"])


@torch.inference_mode()
def test_a_hit_and_a_miss_give_the_same_kv_and_logits(model, tokenizer):
    ingest = engine(model, tokenizer)
    ingest.encode("s")  # what a corpus's ingest stores
    asked = engine(model, tokenizer)  # its own empty store: every module a miss
    hit, miss = ingest.plan(PROMPT), asked.plan(PROMPT)
    assert hit.misses == () and "a" in hit.hits and "a" in miss.misses
    assert torch.equal(hit.kvs["a"].keys, miss.kvs["a"].keys) and torch.equal(hit.kvs["a"].values, miss.kvs["a"].values)
    logits = []
    for pc, plan in ((ingest, hit), (asked, miss), (asked, asked.plan(PROMPT))):
        done = pc.prefill(dataclasses.replace(plan, sources=None))
        logits.append(done.logits)
        release(done.cache)
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[1], logits[2])
    full = ingest.prefill(uncached(hit))
    release(full.cache)
    assert (full.logits - logits[0]).abs().max() > 0  # a cached path, not a full prefill


@pytest.mark.parametrize("neighbours,match", [({"a": ("zz",)}, "'zz'"), ({"a": ("a",)}, "'a'"),
                                              ({"zz": ("a",)}, "'zz'")])
def test_bad_neighbours_are_refused_by_name(neighbours, match, model, tokenizer):
    pc = PromptCache(model, tokenizer, store=MemoryStore())
    pc.add_schema(schema(neighbours))
    with pytest.raises(ValueError, match=f"{match}.*valid: a, b, c"):
        pc.plan(PROMPT)


def test_a_schema_with_other_neighbours_is_other_content(model, tokenizer):
    pc = engine(model, tokenizer)
    pc.add_schema(schema())  # the same: a no-op
    with pytest.raises(ValueError, match="already registered"):
        pc.add_schema(schema({"a": ("b",)}))
