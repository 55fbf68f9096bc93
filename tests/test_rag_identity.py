"""A document's identity in a corpus is its name: the path relative to the directory ingested (a
record: `<that>#<id>`). The same documents ingested from another place (a copied folder) replace the
earlier ones, and the ingest says so; two places in one ingest that give one name are refused."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from test_rag_corpus import FakeEmbedder, FakeEngine, build, write_docs

from rag_promptcache.rag.table import ChunkTable


def test_a_copied_folder_replaces_the_documents_it_names(tmp_path: Path) -> None:
    docs = write_docs(tmp_path / "docs")
    (docs / "misc").mkdir()
    (docs / "misc" / "birds.jsonl").write_text(json.dumps({"id": "robin", "text": "Robins sing at dawn."}) + "\n")
    c = build(docs, tmp_path / "c")
    before = sorted(d["name"] for d in c.documents())
    copy = Path(shutil.copytree(docs, tmp_path / "copy"))
    (copy / "rivers.md").write_text("# Rivers\n\nThe Nile flows south into the Indian Ocean.\n\n")
    report = c.add([copy], progress=False)
    listed = c.documents()
    assert sorted(d["name"] for d in listed) == before  # each once, not twice
    assert all(d["source"].startswith(str(copy.resolve())) for d in listed)  # the copy's, not the original's
    assert len(report.replaced) == len(before) and "replaced 4 document(s) of the same name" in report.summary()
    assert ("rivers.md", str((docs / "rivers.md").resolve())) in report.replaced
    # the old value is gone from retrieval: what `ask` imports is the edited text only
    texts = " ".join(c.text(m) for m, _ in c.table.modules())
    assert "Indian Ocean" in texts and "Mediterranean" not in texts and len(c) == c.info()["num_modules"]
    hit = c.search("which way does the Nile flow", k=1)[0][0]
    assert "Indian Ocean" in c.text(hit) and c.source(hit) == str((copy / "rivers.md").resolve())
    again = c.add([copy], progress=False)  # the same place again: nothing replaced
    assert again.replaced == () and again.num_unchanged == len(before)
    c.close()


def test_two_places_with_one_name_in_one_ingest_are_refused(tmp_path: Path) -> None:
    a = write_docs(tmp_path / "a", {"README.md": "Alpha project readme."})
    b = write_docs(tmp_path / "b", {"README.md": "Beta project readme."})
    with pytest.raises(ValueError, match="both named 'README.md'.*to keep both, ingest a directory above both"):
        _build_many([a, b], tmp_path / "c")
    assert not (tmp_path / "c").exists()
    c = _build_many([tmp_path], tmp_path / "c")  # their parent: a/README.md and b/README.md
    assert sorted(d["name"] for d in c.documents()) == ["a/README.md", "b/README.md"]
    c.close()


def _build_many(inputs: list[Path], where: Path):
    from rag_promptcache.rag.corpus import Corpus

    return Corpus.build(inputs, where, engine=FakeEngine(), embedder=FakeEmbedder(), chunk_tokens=32, overlap=8,
                        progress=False)


def test_a_table_from_before_names_gets_the_column_and_matches_by_label(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "chunks.sqlite")
    db.execute("CREATE TABLE documents(source TEXT PRIMARY KEY, label TEXT NOT NULL, content_hash TEXT NOT NULL, "
               "complete INTEGER NOT NULL, num_bytes INTEGER NOT NULL, updated REAL NOT NULL)")
    db.execute("INSERT INTO documents VALUES('/old/docs/cats.txt', 'cats.txt', 'h', 1, 10, 0)")
    db.commit()
    db.close()
    table = ChunkTable(tmp_path / "chunks.sqlite")
    assert [r.source for r in table.named("cats.txt")] == ["/old/docs/cats.txt"] and table.document("/old/docs/cats.txt").name is None
    table.close()
