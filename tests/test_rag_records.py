"""JSON Lines and JSON records: one document per record, named by its id, other fields kept as
metadata; bad records are reported with their line and skipped, the rest ingested."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_rag_corpus import FakeEmbedder, FakeEngine

from rag_promptcache.rag import Corpus
from rag_promptcache.rag.loaders import LoaderWarning, LoadReport, load

LINES = [
    json.dumps({"id": "faq-1", "text": "Cats purr when they are content.", "lang": "en", "tags": ["pets"]}),
    json.dumps({"text": "The Nile flows north into the Mediterranean Sea."}),  # no id: named by its line
    '{"id": "broken", "text": "unterminated',  # malformed: reported with line 3, skipped
    json.dumps({"id": "empty-1", "title": "no text field here"}),  # reported, not an empty document
    "",
    json.dumps({"id": "faq-1", "text": "A repeated id."}),  # reported: the first faq-1 stays
    json.dumps({"id": 7, "text": "Volcanoes erupt when magma rises."}),
]


def write(path: Path, lines: list[str] = LINES) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_each_record_is_a_document_and_bad_ones_are_reported(tmp_path: Path) -> None:
    f = write(tmp_path / "faq.jsonl")
    (tmp_path / "list.json").write_text(json.dumps([{"id": "a", "body": "Alpha text.", "n": 1}, "Just a string.", {"n": 2}]))
    report = LoadReport()
    with pytest.warns(LoaderWarning) as warned:
        docs = {d.label: d for d in load([f], report=report)}
        listed = {d.label: d for d in load([tmp_path / "list.json"], field_name="body", report=report)}
    assert sorted(docs) == ["7", "faq-1", "faq.jsonl:2"]
    assert "".join(docs["faq-1"].blocks()) == "Cats purr when they are content."
    assert docs["faq-1"].metadata == {"lang": "en", "tags": ["pets"]} and docs["faq-1"].source == f"{f.resolve()}#faq-1"
    skipped = dict(report.skipped)
    assert skipped[f"{f}:3"].startswith("not valid JSON") and f"{f}:3" in str(warned[0].message)
    assert skipped[f"{f}:4"] == "no text in field 'text' (fields: id, title; choose another with --field)"
    assert skipped[f"{f}:6"] == f"repeated id 'faq-1' (first at {f}:1)"
    assert sorted(listed) == ["a", "list.json[1]"] and listed["a"].metadata == {"n": 1}
    assert "no text in field 'body'" in skipped[f"{tmp_path / 'list.json'}[2]"]


def test_records_in_a_corpus_answer_remove_and_update_by_id(tmp_path: Path) -> None:
    f = write(tmp_path / "d" / "faq.jsonl")
    engine = FakeEngine()
    with pytest.warns(LoaderWarning):
        c = Corpus.build([tmp_path / "d"], tmp_path / "c", engine=engine, embedder=FakeEmbedder(), chunk_tokens=32, overlap=4, progress=False)
    assert c.last_report.num_documents == 3 and len(c.last_report.skipped) == 3
    docs = {d["name"]: d for d in c.documents()}
    # a record is listed with its file: a bare "7" says nothing of where it came from
    assert sorted(docs) == ["faq.jsonl#7", "faq.jsonl#faq-1", "faq.jsonl:2"]
    assert docs["faq.jsonl#faq-1"]["metadata"] == {"lang": "en", "tags": ["pets"]}
    assert c.ask("why do cats purr?", k=1).sources == ("faq.jsonl#faq-1",)
    assert c.remove("faq.jsonl#faq-1") == 1  # the name `ask` printed
    assert sorted(d["name"] for d in c.documents()) == ["faq.jsonl#7", "faq.jsonl:2"]
    from rag_promptcache.rag.documents import resolve

    assert resolve(c.table, "7", c.path) == resolve(c.table, "faq.jsonl#7", c.path) == [f"{f.resolve()}#7"]  # the id alone still names it
    # an edited file: one record changed, one gone; only the changed one is re-encoded
    write(f, [json.dumps({"id": 7, "text": "Volcanoes erupt when magma rises. Lava cools."})])
    report = c.add([tmp_path / "d"])
    assert (report.num_ingested, report.num_removed) == (1, 1)
    assert [d["name"] for d in c.documents()] == ["faq.jsonl#7"] and len(c) == 1
    c.close()


@pytest.mark.parametrize("how", ["relative", "absolute", "bare"])
def test_removing_a_records_file_removes_all_its_records(tmp_path: Path, monkeypatch, how: str) -> None:
    """`remove misc/birds.jsonl` (relative, absolute or the bare file name) forgets every record of
    it, and only those: another file's records stay."""
    root = tmp_path / "docs"
    birds = write(root / "misc" / "birds.jsonl", [json.dumps({"id": "robin", "text": "Robins sing at dawn."}),
                                                  json.dumps({"id": "owl", "text": "Owls hunt at night."})])
    write(root / "fish.jsonl", [json.dumps({"id": "trout", "text": "Trout live in cold rivers."})])
    c = Corpus.build([root], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), chunk_tokens=32, overlap=4,
                     progress=False)
    monkeypatch.chdir(root)
    name = {"relative": "misc/birds.jsonl", "absolute": str(birds.resolve()), "bare": "birds.jsonl"}[how]
    assert c.remove(name) == 2
    assert [d["name"] for d in c.documents()] == ["fish.jsonl#trout"] and len(c) == 1
    with pytest.raises(ValueError, match="no document 'birds.jsonl'"):
        c.remove("birds.jsonl")
    c.close()


def test_a_bare_file_name_of_two_records_files_is_ambiguous(tmp_path: Path) -> None:
    for d in ("a", "b"):
        write(tmp_path / "docs" / d / "birds.jsonl", [json.dumps({"id": f"{d}-robin", "text": f"Robins of {d} sing."})])
    c = Corpus.build([tmp_path / "docs"], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), chunk_tokens=32,
                     overlap=4, progress=False)
    with pytest.raises(ValueError, match="'birds.jsonl' names 2 records files.*pass one of these paths"):
        c.remove("birds.jsonl")
    assert c.remove(tmp_path / "docs" / "a" / "birds.jsonl") == 1 and [d["name"] for d in c.documents()] == ["b/birds.jsonl#b-robin"]
    c.close()
