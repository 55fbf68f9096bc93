"""`ast.Schema.neighbours_present` / `ingest --neighbours M --neighbours-present C`: a prompt reads a module's
KV encoded after its neighbours only where at least C of them are in the same prompt, its plain KV (the
entry a schema without neighbours stores) otherwise, chosen per module in the plan, so every path that plans
follows it. Exact where it is plain: the same key, KV and logits as an engine without neighbours. The corpus
writes the plain entries at ingest and the others later (a question that read one plain queues it; a server's
idle time and `warm --all` encode the rest), and drops both with the module.

Engine tests over a tiny random Llama, fp32; corpus tests over a 2-layer random Llama with SmolLM2's tokenizer
(tests/tiny_llama.py) and the real MiniLM embedder."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import pytest
import torch

from rag_promptcache.cli.ingest_cmd import encoded_line
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.engine.planning.plan import Plan
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
def logits(pc: PromptCache, prompt: str | Plan, **plan) -> torch.Tensor:
    done = pc.prefill(dataclasses.replace(pc.plan(prompt, **plan) if isinstance(prompt, str) else prompt, sources=None))
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
    # with both neighbours there, a reads that plain entry too while its entry after them is not stored yet
    assert picking.plan(PROMPT, misses="defer").sources["a"] == reference.sources["a"]


@torch.inference_mode()
def test_an_entry_after_neighbours_not_stored_yet_is_read_plain_and_queued(model, tokenizer):
    store = MemoryStore()
    plain = engine(model, tokenizer, present=0, neighbours={}, store=store)
    plain.encode("s")  # what ingest writes: the plain entries only
    picking = engine(model, tokenizer, present=2, store=store)
    after = engine(model, tokenizer, present=0)
    deferred = picking.plan(PROMPT, misses="defer")  # both neighbours there, but a's entry after them is not stored
    reference = plain.plan(PROMPT)
    assert deferred.sources["a"] == reference.sources["a"] and "a" in deferred.hits and not deferred.misses
    assert deferred.num_encoded_tokens == 0  # nothing encoded in the request: a's entry is queued (once)
    stats = picking.background.stats()
    assert stats.num_queued + stats.num_encoded == 1 and not stats.num_failed
    assert torch.equal(logits(picking, deferred), logits(plain, PROMPT))  # answered exactly as from the plain entries
    picking.background.drain()  # while no request runs (its thread may have begun)
    upgraded = picking.plan(PROMPT, misses="defer")
    assert upgraded.sources["a"] == after.plan(PROMPT).sources["a"] != reference.sources["a"]
    assert torch.equal(upgraded.kvs["a"].keys, after.plan(PROMPT).kvs["a"].keys)
    assert torch.equal(logits(picking, PROMPT, misses="defer"), logits(after, PROMPT))
    # `encode` (a bare engine's misses, what `eval` measures): the request encodes it first, as before
    fresh = MemoryStore()
    engine(model, tokenizer, present=0, neighbours={}, store=fresh).encode("s")
    encoding = engine(model, tokenizer, present=2, store=fresh)
    assert encoding.plan(PROMPT, misses="encode").sources["a"] == upgraded.sources["a"]


# Corpus: the plain entries written at ingest, the others later; read per prompt, both dropped with the module.

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


def test_a_corpus_writes_plain_entries_upgrades_what_questions_read_and_drops_both(parts, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "never")  # the cached path (tests/conftest.py)
    c = corpus(parts, tmp_path / "c", neighbours=2, neighbours_present=2)
    try:
        assert c.manifest.neighbours_present == 2 and c.info()["neighbours_present"] == 2
        rows = dict(c.table.db.execute("SELECT module_id, store_key FROM module_keys").fetchall())
        ids = [m for m, _ in c.table.modules()]
        assert all(m + "#plain" in rows and rows[m + "#plain"] != rows[m] for m in ids)
        store = DiskStore(tmp_path / "c" / "store")
        try:  # ingest wrote the plain entries, as an ingest without neighbours does, and only those
            assert all(store.contains(rows[m + "#plain"]) and not store.contains(rows[m]) for m in ids)
        finally:
            store.close()
        cov = c.coverage()
        assert (cov.num_encoded, cov.num_after_neighbours) == (len(ids), 0)
        assert f"{len(ids)} of {len(ids)} modules encoded, 100% of their tokens; 0 also after their neighbours" in \
            encoded_line(c.info()["encoded"])  # `info`
        one = c.ask("Why do bees dance?", k=1, max_new_tokens=4)  # alone: no neighbour beside it, its plain entry
        assert not one.missed_modules and one.hit_modules == one.module_ids
        assert c.store_deferred() == 0  # nothing better to write for a module read alone
        many = c.ask("Why do bees dance?", k=len(ids), max_new_tokens=4)  # every module: plain now, the rest queued
        assert not many.missed_modules and set(many.hit_modules) == set(ids)
        stats = c.engine.background.stats()  # queued, or written already by the encoder's thread
        assert stats.num_queued + stats.num_encoded == len(ids) and not stats.num_failed
        c.store_deferred()  # what `ask` does once the answer is out (the encoder's thread may have begun)
        assert all(c.engine.store.contains(rows[m]) for m in ids) and c.coverage().num_after_neighbours == len(ids)
        again = c.ask("Why do bees dance?", k=len(ids), max_new_tokens=4)  # each after its neighbours now
        assert set(again.hit_modules) == set(ids) and c.store_deferred() == 0
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


def test_warm_all_and_idle_time_encode_the_entries_after_neighbours(parts, tmp_path):
    c = corpus(parts, tmp_path / "w", neighbours=2, neighbours_present=2)
    try:
        ids = [m for m, _ in c.table.modules()]
        report = c.warm(None)  # `warm --all`: every module, though no question retrieved any yet
        assert (report.num_wanted, report.num_held, report.num_encoded) == (len(ids), 0, len(ids))
        assert c.coverage().num_after_neighbours == len(ids) and c.warm(None).num_encoded == 0  # resumable
    finally:
        c.close()
    c = corpus(parts, tmp_path / "i", neighbours=2, neighbours_present=2)
    try:
        c.warm_when_idle()  # what `serve` calls at start-up
        deadline = time.monotonic() + 120
        while c.coverage().num_after_neighbours < len(ids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert c.coverage().num_after_neighbours == len(ids)
    finally:
        c.close()


def test_idle_upgrades_skip_nothing_when_modules_leave_or_arrive(parts, tmp_path):
    """The idle step (`rag/lazy.py` `Upgrades`) remembers what it encoded by entry, not by table row: modules
    removed behind it shift no row past it, and modules ingested while it runs are found."""
    from rag_promptcache.rag.lazy import Upgrades

    c = corpus(parts, tmp_path / "u", neighbours=2, neighbours_present=2)
    try:
        step = Upgrades(c)
        assert step() and c.coverage().num_after_neighbours == 1  # the first module in ingest order
        first = c.table.module_keys()[0][0]
        gone = next(src for src in (str((parts[1] / n).resolve()) for n in TOPICS) if first in c.table.chunk_ids(src))
        c.remove(gone)  # the rows behind the step leave: the rest move up a row each
        while step():
            pass
        assert c.coverage().num_after_neighbours == len(c) > 0
        extra = tmp_path / "extra"
        extra.mkdir()
        (extra / "tides.txt").write_text("The moon pulls the sea into two bulges, so most shores see two tides a day. " * 6)
        c.add([extra])  # ingested while the idle loop runs
        assert c.coverage().num_after_neighbours < len(c)
        while step():
            pass
        assert c.coverage().num_after_neighbours == len(c)
    finally:
        c.close()


@pytest.mark.slow
def test_a_server_upgrades_a_fresh_corpus_in_idle_time(parts, tmp_path):
    """`serve` over a corpus just ingested (plain entries only) answers at once, and its idle time writes the
    entries after the neighbours, as /metrics counts them."""
    import httpx

    from tests.test_server import start_server

    path = tmp_path / "corpus"
    c = corpus(parts, path, neighbours=2, neighbours_present=2)
    num_modules = len(c)
    c.close()
    proc, url = start_server(path, tmp_path / "serve.log")

    def after_neighbours() -> float:
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith("rag_promptcache:corpus_modules_after_neighbours{"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no corpus_modules_after_neighbours gauge")

    try:
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "corpus", "messages": [{"role": "user", "content": "Why do bees dance?"}], "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        deadline = time.monotonic() + 120
        while after_neighbours() < num_modules and time.monotonic() < deadline:
            time.sleep(0.5)
        assert after_neighbours() == num_modules
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_tune_lays_a_corpus_prompt_out_as_the_corpus_reads_it(parts, tmp_path, tokenizer):
    """`rag-promptcache tune` on a corpus ingested with --neighbours: each module of a training or check prompt
    is laid out after the neighbours the corpus recorded, where enough of them are in the prompt."""
    from rag_promptcache.tune.corpus import neighbourhood
    from rag_promptcache.tune.layout import Layouter

    c = corpus(parts, tmp_path / "t", neighbours=2, neighbours_present=2)
    try:
        near = neighbourhood(c)
        text = dict(c.table.modules())
        assert near is not None and near.present == 2
        assert near.of == {text[m]: tuple(text[n] for n in ns) for m, ns in c.table.neighbours().items()}
        module, (a, b) = next((m, ns) for m, ns in c.table.neighbours().items() if len(ns) == 2)
        layouter = Layouter(tokenizer, c.manifest.mode, near=near)
        both = layouter.lay(c.manifest.instructions, [text[a], text[b], text[module]], "Why?", "")
        one = layouter.lay(c.manifest.instructions, [text[a], text[module]], "Why?", "")  # too few: read plain
        alone = Layouter(tokenizer, c.manifest.mode).lay(c.manifest.instructions, [text[a], text[module]], "Why?", "")
        copied = [t for t, h in zip(both.ids, both.hidden or []) if h]
        assert copied and all(tokenizer.decode(copied).count(text[n].strip()[:40]) for n in (a, b))
        assert (one.ids, one.hidden) == (alone.ids, alone.hidden)
    finally:
        c.close()
    plain = corpus(parts, tmp_path / "p")
    try:
        assert neighbourhood(plain) is None
    finally:
        plain.close()


def test_tune_trains_a_corpus_with_neighbours_on_its_longer_samples(parts, tmp_path):
    """`tune` on a corpus ingested with --neighbours M keeps samples up to M + 1 times the plain length: the
    hidden copies of the neighbours lengthen every one, and the plain limit would drop the larger prompts."""
    from rag_promptcache.tune.corpus import tune_corpus
    from rag_promptcache.tune.train import MAX_LEN, TuneConfig

    c = corpus(parts, tmp_path / "t", neighbours=2, neighbours_present=2)
    try:
        report = tune_corpus(c, tmp_path / "tuned", TuneConfig(rank=2, alpha=4, max_steps=1, tokens_per_batch=2048),
                             general=False, check=0)
    finally:
        c.close()
    assert report.steps == 1
    assert json.loads((tmp_path / "tuned" / "train.json").read_text())["config"]["max_len"] == 3 * MAX_LEN


def test_ask_stores_the_entries_after_neighbours_it_read_plain_before_it_exits(parts, tmp_path, capsys, monkeypatch):
    from test_cli import run

    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "never")  # the cached path (tests/conftest.py)
    c = corpus(parts, tmp_path / "a", neighbours=2, neighbours_present=2)
    n = len(c)
    c.close()
    code, _, err = run(capsys, "ask", "--corpus", tmp_path / "a", "Why do bees dance?", "-k", str(n))
    # the background encoder may have written some before the count is printed: it says what is left
    assert code == 0 and re.search(r"storing \d+ module\(s\) for later questions", err)
    info = json.loads(run(capsys, "info", "--corpus", tmp_path / "a", "--json")[1])
    assert info["encoded"]["num_after_neighbours"] == n
