"""`ast.Schema.neighbours_present` / `ingest --neighbours M --neighbours-present C`: a prompt reads a module's
KV encoded after its neighbours only where at least C of them are in the same prompt, its plain KV (the
entry a schema without neighbours stores) otherwise, chosen per module in the plan, so every path that plans
follows it. Exact where it is plain: the same key, KV and logits as an engine without neighbours. The corpus
stores both entries and drops both with the module.

Engine tests over a tiny random Llama, fp32; corpus tests over a 2-layer random Llama with SmolLM2's tokenizer
(tests/tiny_llama.py) and the real MiniLM embedder."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.rag import Corpus
from rag_promptcache.store import DiskStore, MemoryStore
from tests.test_neighbours import PROMPT, schema
from tests.tiny import build
from tiny_llama import tiny_llama_and_records

ONE_NEIGHBOUR = '<prompt schema="s"><b/><a/><user>What jumps?</user></prompt>'  # b, not c, beside a


def engine(model, tokenizer, present: int, neighbours=None, store=None) -> PromptCache:
    pc = PromptCache(model, tokenizer, store=store or MemoryStore(), recovery="none", fallback="never")
    pc.add_schema(dataclasses.replace(schema(neighbours), neighbours_present=present))
    return pc


@pytest.fixture(scope="module")
def model(tokenizer):
    return build("llama", vocab_size=len(tokenizer))


@torch.inference_mode()
def logits(pc: PromptCache, prompt: str) -> torch.Tensor:
    done = pc.prefill(dataclasses.replace(pc.plan(prompt), sources=None))
    release(done.cache)
    return done.logits


@torch.inference_mode()
def test_a_module_reads_its_plain_entry_where_too_few_neighbours_are_in_the_prompt(model, tokenizer):
    picking = engine(model, tokenizer, present=2)
    after, plain = engine(model, tokenizer, present=0), engine(model, tokenizer, present=0, neighbours={})
    # both of a's neighbours (b, c) in the prompt: the entry encoded after them, as a schema that always reads it
    both = picking.plan(PROMPT)
    assert both.sources["a"] == after.plan(PROMPT).sources["a"] != plain.plan(PROMPT).sources["a"]
    assert torch.equal(logits(picking, PROMPT), logits(after, PROMPT))
    # one of two: the plain entry, key, KV and logits exactly a schema without neighbours'
    one = picking.plan(ONE_NEIGHBOUR)
    reference = plain.plan(ONE_NEIGHBOUR)
    assert one.sources["a"] == reference.sources["a"] != both.sources["a"]
    assert torch.equal(one.kvs["a"].keys, reference.kvs["a"].keys)
    assert torch.equal(one.kvs["a"].values, reference.kvs["a"].values)
    assert torch.equal(logits(picking, ONE_NEIGHBOUR), logits(plain, ONE_NEIGHBOUR))
    assert not torch.equal(logits(after, ONE_NEIGHBOUR), logits(plain, ONE_NEIGHBOUR))  # the choice matters here
    # both entries stored side by side; the keys stay right in either order (no memo of one for the other)
    assert picking.store.contains(both.sources["a"]) and picking.store.contains(one.sources["a"])
    assert picking.plan(PROMPT).sources["a"] == both.sources["a"] and picking.plan(ONE_NEIGHBOUR).sources["a"] == one.sources["a"]
    # one neighbour is enough at neighbours_present=1
    assert engine(model, tokenizer, present=1).plan(ONE_NEIGHBOUR).sources["a"] == both.sources["a"]


@torch.inference_mode()
def test_a_deferred_plain_miss_is_encoded_plain_in_the_background(model, tokenizer):
    picking = engine(model, tokenizer, present=2)
    plan = picking.plan(ONE_NEIGHBOUR, misses="defer", recovery="last:1")
    assert "a" in plan.deferred
    picking.background.drain()  # what the background encoder does while no request runs
    reference = engine(model, tokenizer, present=0, neighbours={}).plan(ONE_NEIGHBOUR)
    stored = picking.store.get(reference.sources["a"])  # under the plain key, the plain KV
    assert stored is not None and torch.equal(stored.keys, reference.kvs["a"].keys)
    assert not picking.store.contains(picking.plan(PROMPT, misses="defer").sources.get("a", "?"))


# Corpus: both entries written at ingest, read per prompt, dropped with the module.

TOPICS = {
    "rivers.txt": "The Nile flows north through eleven countries into the Mediterranean Sea. ",
    "volcanoes.txt": "Lava cools into basalt rock when it meets the sea near an erupting volcano. ",
    "bees.txt": "Honey bees dance in a figure eight to tell the hive where the flowers are. ",
}


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    return tiny_llama_and_records(tmp_path_factory, TOPICS, 8)


def corpus(parts, path, **kw) -> Corpus:
    model, docs, emb = parts
    return Corpus.build([docs], path, model=model, embedder=emb, chunk_tokens=48, progress=False, redis_url="", **kw)


def test_a_corpus_stores_both_entries_reads_each_where_it_belongs_and_drops_both(parts, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "never")  # the cached path (tests/conftest.py)
    c = corpus(parts, tmp_path / "c", neighbours=2, neighbours_present=2)
    try:
        assert c.manifest.neighbours_present == 2 and c.info()["neighbours_present"] == 2
        rows = dict(c.table.db.execute("SELECT module_id, store_key FROM module_keys").fetchall())
        ids = [m for m, _ in c.table.modules()]
        assert all(m + "#plain" in rows and rows[m + "#plain"] != rows[m] for m in ids)
        store = DiskStore(tmp_path / "c" / "store")
        try:
            assert all(store.contains(k) for k in rows.values())  # ingest wrote both
        finally:
            store.close()
        one = c.ask("Why do bees dance?", k=1, max_new_tokens=4)  # alone: no neighbour beside it, its plain entry
        assert not one.missed_modules and one.hit_modules == one.module_ids
        many = c.ask("Why do bees dance?", k=len(ids), max_new_tokens=4)  # every module: each after its neighbours
        assert not many.missed_modules and set(many.hit_modules) == set(ids)
        gone = c.table.chunk_ids(str((parts[1] / "bees.txt").resolve()))
        c.remove("bees.txt")
        for m in gone:
            assert not c.engine.store.contains(rows[m]) and not c.engine.store.contains(rows[m + "#plain"])
        left = dict(c.table.db.execute("SELECT module_id, store_key FROM module_keys").fetchall())
        assert not any(k.removesuffix("#plain") in gone for k in left)
    finally:
        c.close()


def test_bad_settings_are_refused_by_name(parts, tmp_path):
    with pytest.raises(ValueError, match="neighbours_present .* from 0 .* 0"):
        corpus(parts, tmp_path / "a", neighbours_present=1)  # without neighbours
    with pytest.raises(ValueError, match="neighbours_present .* 2\\), got 3"):
        corpus(parts, tmp_path / "b", neighbours=2, neighbours_present=3)
    c = corpus(parts, tmp_path / "c", neighbours=2, neighbours_present=1)
    c.close()
    with pytest.raises(ValueError, match="neighbours_present=1, not 2"):
        corpus(parts, tmp_path / "c", neighbours_present=2)
