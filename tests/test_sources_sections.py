"""Sources name the section, not only the file: each hit carries its chunk's title and heading path and
a snippet (`Corpus.hit`, filled in one place), and `ask`, `ask --json` and `chat`'s /sources show
`file › section`. Over the fake engine and embedder of test_rag_corpus; the server, the page and the
adapters translate the same record (test_server_window.py, test_page.py, the adapters' tests)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import fakes, run  # noqa: F401 - fakes is a fixture
from test_rag_corpus import build, write_docs

from rag_promptcache.cli.output import source_lines
from rag_promptcache.rag.retrieval import Hit, section_of, shorten

DOCS = {
    "fs.md": "# File system\n\n## Callback API\n\n### fs.mkdir(path, callback)\n\n"
             "Asynchronously creates a directory. The callback gets a possible exception.\n\n"
             "## Promises API\n\n### fsPromises.rm(path)\n\nRemoves files and directories, modeled on rm.",
    "notes.txt": "Plain notes without a title or headings about the kettle and the teapot.",
    "untitled.md": "Some words before any heading.\n\n## Setup\n\nInstall the kettle before you boil water.",
}


@pytest.fixture
def corpus(tmp_path: Path):
    return build(write_docs(tmp_path / "docs", DOCS), tmp_path / "c")


def test_each_hit_knows_its_section_and_snippet(corpus):
    by_text = {}
    for question in ("How does mkdir create a directory?", "How do I remove files with rm?", "kettle teapot notes",
                     "install the kettle setup"):
        for hit in corpus.retrieve(question, k=4):
            by_text[hit.snippet] = hit
    mkdir = next(h for s, h in by_text.items() if "creates a directory" in s)
    assert (mkdir.label, mkdir.section) == ("fs.md", "File system › Callback API › fs.mkdir(path, callback)")
    assert mkdir.where == "fs.md › File system › Callback API › fs.mkdir(path, callback)"
    assert mkdir.snippet.startswith("Asynchronously creates a directory.") and "[" not in mkdir.snippet  # no header line
    rm = next(h for s, h in by_text.items() if "Removes files" in s)
    assert rm.section == "File system › Promises API › fsPromises.rm(path)"
    notes = next(h for h in by_text.values() if h.label == "notes.txt")
    assert (notes.section, notes.where) == ("", "notes.txt")  # no title, no headings: the file alone
    setup = next(h for s, h in by_text.items() if "Install the kettle" in s)
    assert setup.where == "untitled.md › Setup"  # no title: the label is not repeated before the heading
    named = corpus.hit(mkdir.module_id)  # a module named by id (the server's module_ids) gets the same record
    assert (named.section, named.snippet, named.score) == (mkdir.section, mkdir.snippet, None)


def test_the_answer_record_carries_sections_and_snippets(corpus):
    answer = corpus.ask("How does mkdir create a directory?", k=2)
    hits = corpus.retrieve("How does mkdir create a directory?", k=2)
    assert answer.sections == tuple(h.section for h in hits) and answer.snippets == tuple(h.snippet for h in hits)
    assert "File system › Callback API › fs.mkdir(path, callback)" in answer.sections
    stream = corpus.ask_stream("How does mkdir create a directory?", k=2)
    assert "".join(stream) and stream.answer.sections == answer.sections


def test_snippets_and_lines_fit_their_room():
    assert section_of("File system › Callback API", "fs.md") == "File system › Callback API"
    assert section_of("a.md", "a.md") == "" and section_of("a.md › Setup", "a.md") == "Setup"
    text = "word " * 100
    assert shorten(text, 40).endswith(" …") and len(shorten(text, 40)) <= 42 and shorten("a  b\nc") == "a b c"
    hit = Hit("m1", "fs.md", 0.61234, "File system › Callback API", "Asynchronously creates a directory. " * 5)
    wide, narrow = source_lines([(hit.where, hit.score, hit.snippet)], 120), source_lines([(hit.where, hit.score, hit.snippet)], 50)
    assert wide[0].startswith("  fs.md › File system › Callback API (0.61): Asynchronously creates") and len(wide[0]) <= 120
    assert narrow == ["  fs.md › File system › Callback API (0.61)"]  # no room for a snippet: none, not a stub


def test_ask_ask_json_and_chat_show_file_and_section(tmp_path: Path, fakes, capsys, monkeypatch):  # noqa: F811
    assert run(capsys, "ingest", write_docs(tmp_path / "docs", DOCS), "--corpus", tmp_path / "c", "--chunk-tokens", "32")[0] == 0
    monkeypatch.setenv("COLUMNS", "160")
    code, out, err = run(capsys, "ask", "How does mkdir create a directory?", "--corpus", tmp_path / "c", "-k", "2")
    assert code == 0, err
    listed = out.split("\nsources:\n", 1)[1].splitlines()
    assert any(line.startswith("  fs.md › File system › Callback API › fs.mkdir(path, callback) (")
               and "Asynchronously creates a directory." in line for line in listed), out
    code, out, _ = run(capsys, "ask", "How does mkdir create a directory?", "--corpus", tmp_path / "c", "-k", "2", "--json")
    data = json.loads(out)
    assert len(data["sections"]) == len(data["snippets"]) == len(data["module_ids"]) == 2
    assert "File system › Callback API › fs.mkdir(path, callback)" in data["sections"]
    lines = iter(["How does mkdir create a directory?", "/sources", "/quit"])
    monkeypatch.setattr("rag_promptcache.cli.commands._prompt", lambda text: next(lines))
    code, out, err = run(capsys, "chat", "--corpus", tmp_path / "c", "-k", "2")
    assert code == 0, err
    assert "  fs.md › File system › Callback API › fs.mkdir(path, callback) (" in out.split("/sources", 1)[-1], out
