"""`Corpus.build(neighbours=M)` / `ingest --neighbours M`: each module's KV encoded after its M nearest
modules by the corpus's own dense index, least similar first; the choice recorded in the table so every
process compiles the same keys; eager and lazy corpora store the same keys and answer alike; a removed
neighbour leaves the modules that named it, re-encoded with the ones left; a different setting refused
by name; with --ray only M is checked (tests/test_ray_ingest.py ingests with both, on the CLI too).

Over a 2-layer random Llama with SmolLM2's tokenizer (tests/tiny_llama.py) and the real MiniLM embedder."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

from rag_promptcache.rag import Corpus
from rag_promptcache.rag.table import ChunkTable
from rag_promptcache.store import DiskStore
from tiny_llama import tiny_llama_and_records

TOPICS = {
    "rivers.txt": "The Nile flows north through eleven countries into the Mediterranean Sea. ",
    "volcanoes.txt": "Lava cools into basalt rock when it meets the sea near an erupting volcano. ",
    "bees.txt": "Honey bees dance in a figure eight to tell the hive where the flowers are. ",
}
QUESTION = "Why do bees dance?"


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple[str, Path, object]:
    return tiny_llama_and_records(tmp_path_factory, TOPICS, 20)


def build(parts, path: Path, inputs=None, **kw) -> Corpus:
    model, docs, emb = parts
    return Corpus.build(inputs or [docs], path, model=model, embedder=emb, chunk_tokens=48, progress=False,
                        redis_url="", **kw)


def keys_of(c: Corpus) -> dict[str, str]:
    return {m: k for m, k, _ in c.table.module_keys()}


def test_neighbours_are_the_nearest_earlier_modules_least_similar_first(parts, tmp_path):
    c = build(parts, tmp_path / "c", neighbours=2)
    try:
        assert c.manifest.neighbours == 2 and c.info()["neighbours"] == 2
        order = [m for m, _ in c.table.modules()]
        assert len(order) > 16  # more than one ingest batch (BATCH_CHUNKS): earlier batches are found too
        _, vectors = c.table.vectors(c.manifest.dim)
        vec = dict(zip(order, vectors))
        near = c.table.neighbours()
        assert set(near) == set(order)
        for i, m in enumerate(order):
            names = near[m]
            assert len(names) == 2 and m not in names
            scores = [float(vec[m] @ vec[n]) for n in names]
            assert scores == sorted(scores)  # the most similar right before the module
            # every module ingested before it was a candidate: none of them is nearer than those chosen
            others = [float(vec[m] @ vec[o]) for o in order[:i] if o not in names]
            assert all(s <= scores[0] + 1e-6 for s in others)
        # every process compiles the keys ingest recorded: the corpus schema's, as a question plans them
        assert c.engine.store_keys(c.manifest.name, order) == keys_of(c)
        answer = c.ask(QUESTION, k=3, max_new_tokens=4)
        assert not answer.missed_modules and set(answer.hit_modules) == set(answer.module_ids)
    finally:
        c.close()
    again = Corpus.open(tmp_path / "c", embedder=parts[2])
    try:
        assert again.engine.store_keys(again.manifest.name, order) == keys_of(again)
        assert not again.ask(QUESTION, k=3, max_new_tokens=4).missed_modules
    finally:
        again.close()


def test_lazy_and_eager_store_the_same_keys_and_answer_alike(parts, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "never")  # both read the store (tests/conftest.py)
    plain = build(parts, tmp_path / "p")
    eager, lazy = build(parts, tmp_path / "e", neighbours=2), build(parts, tmp_path / "l", neighbours=2, kv="lazy")
    try:
        assert keys_of(eager) == keys_of(lazy)
        assert eager.table.neighbours() == lazy.table.neighbours()
        shared = set(keys_of(plain)) & set(keys_of(eager))
        assert shared and all(keys_of(plain)[m] != keys_of(eager)[m] for m in shared)
        assert plain.table.neighbours() == {} and plain.manifest.neighbours == 0
        first = lazy.ask(QUESTION, k=3, max_new_tokens=8)
        assert set(first.deferred_modules) == set(first.module_ids)  # lazy: the first retrieval, stored after it
        lazy.store_deferred()  # what the background encoder does while no request runs
        held = DiskStore(tmp_path / "l" / "store")
        try:
            assert all(held.contains(keys_of(lazy)[m]) for m in first.module_ids)  # after their neighbours, as eager
        finally:
            held.close()
        a, b = eager.ask(QUESTION, k=3, max_new_tokens=8), lazy.ask(QUESTION, k=3, max_new_tokens=8)
        assert a.module_ids == b.module_ids and a.answer == b.answer
        assert not a.missed_modules and not b.missed_modules
    finally:
        for c in (plain, eager, lazy):
            c.close()


def test_a_removed_neighbour_leaves_the_lists_and_its_modules_are_encoded_again(parts, tmp_path):
    more = tmp_path / "more_rivers.txt"  # one module, its nearest rivers.txt's chunks
    more.write_text("The Nile flows north through eleven countries into the Mediterranean Sea, as noted in record 3.")
    c = build(parts, tmp_path / "c", [parts[1], more], neighbours=2)
    try:
        gone = c.table.chunk_ids(str((parts[1] / "rivers.txt").resolve()))
        assert gone
        before, old_keys = c.table.neighbours(), keys_of(c)
        named = {m for m, ns in before.items() if set(ns) & gone and m not in gone}
        assert named  # some kept module was encoded after a rivers chunk
        c.remove("rivers.txt")
        after, new_keys = c.table.neighbours(), keys_of(c)
        for m in named:
            assert after.get(m, ()) == tuple(n for n in before[m] if n not in gone)
            assert new_keys[m] != old_keys[m]
        for m in set(new_keys) - named:
            assert new_keys[m] == old_keys[m]
        ids = [m for m, _ in c.table.modules()]
        assert c.engine.store_keys(c.manifest.name, ids) == new_keys
        store = c.engine.store
        assert all(store.contains(new_keys[m]) and not store.contains(old_keys[m]) for m in named)
        answer = c.ask(QUESTION, k=3, max_new_tokens=4)
        assert not answer.missed_modules
    finally:
        c.close()


def test_settings_are_kept_and_bad_ones_refused(parts, tmp_path):
    c = build(parts, tmp_path / "c", neighbours=1)
    c.close()
    with pytest.raises(ValueError, match=r"neighbours=1, not 2"):
        build(parts, tmp_path / "c", neighbours=2)
    build(parts, tmp_path / "c").close()  # not asked: the corpus's own
    for bad in (-1, 17, 1.5, True):
        with pytest.raises(ValueError, match="neighbours must be a whole number from 0"):
            build(parts, tmp_path / "x", neighbours=bad)
    assert not (tmp_path / "x").exists()


def test_an_old_table_gains_an_empty_neighbours_column(tmp_path):
    db = sqlite3.connect(tmp_path / "t.sqlite")
    db.execute("CREATE TABLE modules(module_id TEXT PRIMARY KEY, faiss_id INTEGER UNIQUE NOT NULL, text TEXT NOT NULL, "
               "num_tokens INTEGER NOT NULL, vector BLOB NOT NULL)")
    db.execute("INSERT INTO modules VALUES('m', 1, 'x', 1, ?)", (np.zeros(2, np.float32).tobytes(),))
    db.commit()
    db.close()
    table = ChunkTable(tmp_path / "t.sqlite")
    try:
        assert table.neighbours() == {} and table.modules() == [("m", "x")]
    finally:
        table.close()


def run(capsys, *args: str) -> tuple[int, str]:
    from rag_promptcache.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in args])
    out = capsys.readouterr()
    return exc.value.code, " ".join((out.out + out.err).split())  # help is wrapped to the terminal


def test_the_cli_says_the_cost_and_checks_m_with_ray_too(tmp_path, capsys):
    code, help_text = run(capsys, "ingest", "--help")
    assert code == 0 and "--neighbours" in help_text and "(M+1)x" in help_text and "not with --ray" not in help_text
    (tmp_path / "d.txt").write_text("text")
    code, out = run(capsys, "ingest", tmp_path / "d.txt", "--corpus", tmp_path / "c", "--neighbours", "17", "--ray")
    assert code == 1 and "neighbours must be a whole number from 0 (off) to 16" in out and "Ray" not in out
    assert not (tmp_path / "c").exists()
