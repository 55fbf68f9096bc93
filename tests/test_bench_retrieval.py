"""benchmarks/retrieval.py's parts without the model: the committed question set, which module
answers a question, the recall rows, and what counts as a leaked label or navigation line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import retrieval_data
from benchmarks.retrieval import leaks, recall_rows
from rag_promptcache.rag.corpus import Corpus
from tests.test_rag_corpus import FakeEmbedder, FakeEngine


def test_the_committed_set_is_well_formed() -> None:
    raw = json.loads(retrieval_data.DATA.read_text())
    pages = {(m, p) for m, spec in raw["manuals"].items() for p in spec["pages"]}
    assert len(raw["questions"]) >= 60
    for q in raw["questions"]:
        assert (q["manual"], q["page"]) in pages and q["answers"] and q["evidence"] and q["question"].endswith("?")


def _manual(tmp_path: Path) -> Path:
    root = tmp_path / "doc"
    root.mkdir()
    (root / "wal.html").write_text(
        "<html><head><title>WAL</title></head><body><h1>Checkpointing</h1>"
        "<p>By default, SQLite does a checkpoint automatically when the WAL file reaches a threshold size of 1000 pages.</p>"
        "<h1>Concurrency</h1><p>Readers do not block writers, and a writer does not block readers.</p></body></html>")
    (root / "vacuum.html").write_text(
        "<html><head><title>VACUUM</title></head><body><p>VACUUM may need twice the size of the database in free space.</p>"
        "</body></html>")
    data = {"manuals": {"toy": {"package": "toy-doc", "dir": str(root), "pages": ["wal.html", "vacuum.html"]}},
            "questions": [{"manual": "toy", "page": "wal.html", "question": "When does SQLite checkpoint by itself?",
                           "answers": ["1000"], "evidence": "reaches a threshold size of 1000 pages"},
                          {"manual": "toy", "page": "vacuum.html", "question": "How much free space can VACUUM need?",
                           "answers": ["twice"], "evidence": "twice the size of the database"}]}
    (tmp_path / "set.json").write_text(json.dumps(data))
    return tmp_path / "set.json"


def test_load_gold_and_recall_rows(tmp_path: Path) -> None:
    pages, questions = retrieval_data.load(_manual(tmp_path))
    c = Corpus.build(pages["toy"], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), chunk_tokens=64,
                     overlap=0, progress=False)
    texts = retrieval_data.by_source(c)
    relevant = [retrieval_data.gold(texts, q) for q in questions]
    assert all(len(r) == 1 for r in relevant)
    assert "1000 pages" in c.text(next(iter(relevant[0])))
    rows = recall_rows(c, [q.question for q in questions], relevant, "toy")
    assert [r["mode"] for r in rows] == ["hybrid", "dense", "lexical"]
    hybrid = rows[0]
    assert hybrid["questions"] == 2 and hybrid["recall@8"] == 1.0 and 0 < hybrid["mrr"] <= 1
    assert retrieval_data.ranks(["a", "b", "c"], {"c"}) == 3 and retrieval_data.ranks(["a"], {"z"}) is None
    c.close()


def test_a_missing_manual_names_make_manuals(tmp_path: Path) -> None:
    path = _manual(tmp_path)
    (tmp_path / "doc" / "vacuum.html").unlink()
    with pytest.raises(ValueError, match="make manuals.*apt-get install toy-doc"):
        retrieval_data.load(path)


def test_leaks() -> None:
    labels = {"git-stash.html"}
    assert leaks("See [manual/readme.html] for more.", labels)["label"]
    assert leaks("As git-stash.html says, use -k.", labels)["label"]
    assert leaks("SQLite › 2.1 Checkpointing: 1000 pages", labels)["context"]
    assert leaks("1000 pages.\nPrev | Up | Next", labels)["navigation"]
    assert leaks("Use --keep-index to keep the index.", labels) == {"label": False, "context": False, "navigation": False}
