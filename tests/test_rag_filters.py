"""Metadata on every chunk and filters inside the search, on real FAISS (flat, HNSW, IVF) and BM25 indexes
over a corpus built with the fake engine and embedder of test_rag_corpus.py: what each chunk carries (files,
front matter, records, objects), that a filtered search returns only matching chunks and k of them whenever
k match (the exact restricted ranking, not a post-filtered top k), refusals by name, a lazy corpus, an
interrupted ingest, a corpus from before metadata was kept, and `ask --where`."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from tests.test_cli import assert_user_error, run, use_fake_models

from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag import retrieval
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.filters import Filter
from tests.test_rag_corpus import FakeEmbedder, FakeEngine, build, stop_after, write_docs

# Every file holds several chunks about the same things, so an unfiltered search mixes them.
DOCS = {
    "guide/fs.md": "---\ntitle: Files guide\nyear: 2021\ntags: [io, disk]\n---\n# Files\n\n"
                   + "Open a file and read its bytes from the disk cache. " * 6 + "\n\n## Sync\n\n"
                   + "Sync flushes the file bytes to the disk before the cache is dropped. " * 6 + "\n",
    "guide/net.md": "# Network\n\n" + "A socket reads bytes from the network cache like a file. " * 8 + "\n",
    "notes/cache.txt": "The disk cache keeps file bytes in memory. " * 12 + "\n",
    "faq.jsonl": "".join(json.dumps({"id": f"q{i}", "text": f"Question {i}: how is the file cache flushed to disk? " * 3,
                                     "year": 2018 + i, "lang": "en" if i % 2 else "de"}) + "\n" for i in range(6)),
}
QUESTION = "how are file bytes flushed from the disk cache"


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    return write_docs(tmp_path / "docs", DOCS)


def sources(c: Corpus, hits) -> set[str]:
    return {c.metadata(m)["source"] for m, _ in hits}


def test_every_chunk_carries_its_documents_metadata(docs: Path, tmp_path: Path) -> None:
    os.utime(docs / "notes/cache.txt", (1_700_000_000, 1_700_000_000))
    c = build(docs, tmp_path / "c")
    meta = {m: c.metadata(m) for m, _ in c.table.modules()}
    fs = [v for v in meta.values() if v["source"] == "guide/fs.md"]
    assert {v["section"] for v in fs} == {"", "Sync"} and all(v["type"] == "md" for v in fs)
    # front matter: its own fields, its title over the first heading's
    assert fs[0]["title"] == "Files guide" and fs[0]["year"] == 2021 and fs[0]["tags"] == ["io", "disk"]
    assert fs[0]["path"] == str((docs / "guide/fs.md").resolve())
    notes = next(v for v in meta.values() if v["source"] == "notes/cache.txt")
    assert notes["modified"] == "2023-11-14T22:13:20Z" and notes["type"] == "txt" and notes["title"] == ""
    q3 = next(v for v in meta.values() if v["source"] == "faq.jsonl#q3")
    assert q3 == {**q3, "year": 2021, "lang": "en", "type": "record", "path": str((docs / "faq.jsonl").resolve())}
    assert set(c.catalog.keys()) == {"source", "path", "type", "title", "modified", "section", "year", "tags", "lang"}
    with pytest.raises(ValueError, match="no module 'm0000000000000000'"):
        c.metadata("m0000000000000000")
    c.close()


@pytest.mark.parametrize("index", ["flat", "hnsw", "ivf"])
def test_a_filter_applies_inside_the_search(docs: Path, tmp_path: Path, index: str) -> None:
    c = build(docs, tmp_path / "c", index=index)
    every = c.search(QUESTION, k=len(c), mode="dense")
    assert len(sources(c, every)) >= 4  # unfiltered, the question reaches every document
    for flt in ({"source": "guide/fs.md"}, {"type": "record", "year": {"$gte": 2021}}, {"section": "Sync"},
                {"$or": [{"lang": "de"}, {"source": {"$glob": "notes/*"}}]}, {"path": {"$prefix": str(docs / "guide")}}):
        allowed = c.catalog.matching(flt)
        assert len(allowed) >= 1
        for mode in retrieval.MODES:
            hits = c.search(QUESTION, k=len(allowed), mode=mode, filter=flt)
            assert hits
            assert all(Filter.parse(flt).matches(c.metadata(m)) for m, _ in hits), (flt, mode)
            if mode != "lexical":  # k come back whenever k match (BM25 alone returns only chunks sharing a word)
                assert len(hits) == len(allowed), (flt, mode)
        if index == "flat":  # the exact restricted ranking, not the unfiltered top k filtered afterwards
            want = [s for m, s in every if Filter.parse(flt).matches(c.metadata(m))][:2]
            assert [s for _, s in c.search(QUESTION, k=2, mode="dense", filter=flt)] == pytest.approx(want)  # ties may swap ids
    c.close()


def test_the_top_up_is_the_exact_ranking_over_the_allowed_modules(docs: Path, tmp_path: Path) -> None:
    """Where an HNSW walk or the IVF lists probed hold fewer allowed modules than asked for, the dense
    ranking is `retrieval.exact` over the allowed modules' stored vectors: the ranking a flat index gives."""
    c = build(docs, tmp_path / "c", index="flat")
    allowed = c.catalog.matching({"type": {"$ne": "md"}})
    vector = c.embedder.embed([QUESTION])
    flat = c.index.search(vector, len(c), allowed)[0]
    got = retrieval.exact(c.table, vector[0], allowed, len(allowed))
    assert len(got) == len(flat) == len(allowed)
    assert [s for _, s in got] == pytest.approx([s for _, s in flat])
    assert retrieval.exact(c.table, vector[0], allowed[:0], 4) == []
    c.close()


def test_unknown_keys_and_bad_filters_are_refused_by_name(docs: Path, tmp_path: Path) -> None:
    c = build(docs, tmp_path / "c")
    with pytest.raises(ValueError) as e:
        c.search(QUESTION, filter={"yaer": 2021})
    assert str(e.value) == ("unknown filter key(s) 'yaer'; valid: lang, modified, path, section, source, tags, title, "
                            "type, year")
    with pytest.raises(ValueError, match="unknown filter operator '\\$regex' for key 'source'"):
        c.ask(QUESTION, filter={"source": {"$regex": ".*"}})
    with pytest.raises(ValueError, match="unknown filter key"):
        c.retrieve_turns([("user", QUESTION)], filter={"nope": 1})
    c.close()


def test_ask_within_a_filter_and_a_filter_matching_nothing(docs: Path, tmp_path: Path) -> None:
    c = build(docs, tmp_path / "c")
    answer = c.ask(QUESTION, k=3, filter={"source": "guide/net.md"})
    assert set(answer.sources) == {"guide/net.md"}
    assert {h.label for h in c.retrieve(QUESTION, k=3, filter={"lang": "de"})} == {"faq.jsonl#q0", "faq.jsonl#q2", "faq.jsonl#q4"}
    none = c.ask(QUESTION, filter={"year": {"$gt": 3000}})
    assert none.answer == retrieval.NOT_FOUND and none.path == "none" and not none.sources
    # a conversation's remembered retrieval is per filter: the same turns under another one search again
    a = c.retrieve_turns([("user", QUESTION)], k=2, filter={"source": "guide/net.md"})
    b = c.retrieve_turns([("user", QUESTION)], k=2, filter={"source": "notes/cache.txt"})
    assert {h.label for h in a.hits} == {"guide/net.md"} and {h.label for h in b.hits} == {"notes/cache.txt"}
    c.close()


def test_filters_on_a_lazy_corpus(docs: Path, tmp_path: Path) -> None:
    c = build(docs, tmp_path / "c", kv="lazy")
    assert c.manifest.kv == "lazy"
    hits = c.search(QUESTION, k=3, filter={"tags": "disk", "section": "Sync"})
    assert hits and sources(c, hits) == {"guide/fs.md"} and all(c.metadata(m)["section"] == "Sync" for m, _ in hits)
    c.close()


def test_filters_on_an_interrupted_ingest_and_after_it_resumes(docs: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(corpus_mod, "BATCH_CHUNKS", 4)
    with pytest.raises(KeyboardInterrupt):
        build(docs, tmp_path / "c", on_batch=stop_after(2))
    partial = Corpus.open(tmp_path / "c", FakeEngine(), embedder=FakeEmbedder())
    assert partial.info()["num_incomplete"] > 0
    committed = {d["source"] for d in partial.documents() if d["num_chunks"]}
    assert committed
    name = next(d["name"] for d in partial.documents() if d["num_chunks"])
    hits = partial.search(QUESTION, k=len(partial), filter={"source": name})
    assert hits and sources(partial, hits) == {name}  # what was committed is found, with its metadata
    partial.add([docs], progress=False)
    assert partial.info()["num_incomplete"] == 0
    for flt in ({"type": "record"}, {"year": 2021}):
        assert len(partial.search(QUESTION, k=50, filter=flt)) == len(partial.catalog.matching(flt))
    partial.close()


def _as_before_metadata(path: Path) -> None:
    """The table as a corpus made before metadata was kept has it: no kind, title or modified columns."""
    db = sqlite3.connect(path / "chunks.sqlite")
    db.executescript("CREATE TABLE old AS SELECT source, label, content_hash, complete, num_bytes, updated, name FROM documents;"
                     "DROP TABLE documents; ALTER TABLE old RENAME TO documents;")
    db.commit()
    db.close()


def test_a_corpus_from_before_metadata_derives_what_it_can_and_an_ingest_records_the_rest(docs: Path, tmp_path: Path) -> None:
    build(docs, tmp_path / "c").close()
    _as_before_metadata(tmp_path / "c")
    engine = FakeEngine()
    c = Corpus.open(tmp_path / "c", engine, embedder=FakeEmbedder())
    # derived from what the table holds: the name, the file, the kind; the records' own fields were kept
    assert sources(c, c.search(QUESTION, k=2, filter={"source": "notes/cache.txt"})) == {"notes/cache.txt"}
    assert {c.metadata(m)["type"] for m, _ in c.search(QUESTION, k=50, filter={"year": {"$lt": 2020}})} == {"record"}
    assert c.metadata(c.search(QUESTION, k=1, filter={"section": "Sync"})[0][0])["type"] == "md"
    with pytest.raises(ValueError) as e:
        c.search(QUESTION, filter={"modified": {"$gte": "2020-01-01"}})
    assert "unknown filter key(s) 'modified'" in str(e.value)
    assert "not recorded for the 9 document(s) ingested before metadata was kept; `ingest` the same paths again" in str(e.value)
    encoded = len(engine.encode_calls)
    report = c.add([docs], progress=False)
    assert report.num_ingested == 0 and len(engine.encode_calls) == encoded  # nothing encoded again
    assert len(c.search(QUESTION, k=50, filter={"modified": {"$gte": "2020-01-01"}})) == len(c)
    assert sources(c, c.search(QUESTION, k=50, filter={"title": "Files guide"})) == {"guide/fs.md"}
    c.close()


def test_a_touched_file_gets_its_new_modification_time_without_encoding(docs: Path, tmp_path: Path) -> None:
    engine = FakeEngine()
    c = build(docs, tmp_path / "c", engine)
    encoded = len(engine.encode_calls)
    os.utime(docs / "guide/net.md", (2_000_000_000, 2_000_000_000))
    assert not c.search(QUESTION, k=5, filter={"modified": {"$gte": "2033-01-01"}})
    c.add([docs], progress=False)
    assert sources(c, c.search(QUESTION, k=5, filter={"modified": {"$gte": "2033-01-01"}})) == {"guide/net.md"}
    assert len(engine.encode_calls) == encoded
    c.close()


def test_objects_keep_their_metadata(tmp_path: Path) -> None:
    from langchain_core.documents import Document

    docs = [Document(page_content=f"Fact {i} about the file cache and the disk.", metadata={"source": f"f{i}.txt", "team": t})
            for i, t in enumerate(["infra", "web", "infra"])]
    c = Corpus.build(docs, tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), progress=False)
    hits = c.search("file cache", k=3, filter={"team": "infra"})
    assert sources(c, hits) == {"f0.txt", "f2.txt"} and c.metadata(hits[0][0])["type"] == "object"
    c.close()


def test_ask_where(docs: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    use_fake_models(monkeypatch, FakeEngine())
    code, _, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32", "--overlap", "8")
    assert code == 0, err
    code, out, err = run(capsys, "ask", "--corpus", tmp_path / "c", QUESTION, "-k", "3", "--json",
                         "--where", "type=record", "--where", "lang=de", "--where", "year>=2019")
    assert code == 0, err
    assert set(json.loads(out)["sources"]) == {"faq.jsonl#q2", "faq.jsonl#q4"}
    code, out, err = run(capsys, "ask", "--corpus", tmp_path / "c", QUESTION, "--where", "source~guide/*", "--where",
                         "source=guide/fs.md", "--where", "source=notes/cache.txt")
    assert code == 0 and "sources:\n  guide/fs.md ›" in out, err
    assert_user_error(run(capsys, "ask", "--corpus", tmp_path / "c", QUESTION, "--where", "lnag=de"),
                      "unknown filter key(s) 'lnag'; valid: lang, modified")
    assert_user_error(run(capsys, "ask", "--corpus", tmp_path / "c", QUESTION, "--where", "lang"), "expected KEY=VALUE")
    code, out, _ = run(capsys, "ask", "--corpus", tmp_path / "c", QUESTION, "--where", "year>3000")
    assert code == 0 and retrieval.NOT_FOUND in out and "matched --where" in out
