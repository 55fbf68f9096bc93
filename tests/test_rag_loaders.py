"""Loaders: every format from real files, directories, framework objects, skips, and streaming."""

from __future__ import annotations

import logging

import json
import tracemalloc
import warnings
from pathlib import Path

import pytest

from rag_promptcache.rag.loaders import LoaderWarning, LoadReport, load


def text_of(doc) -> str:
    return "".join(doc.blocks())


def minimal_pdf(text: str) -> bytes:
    """A one-page PDF with one line of Helvetica text, byte offsets computed for the xref table."""
    stream = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_each_format(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("Plain text.\r\nSecond line.")
    (tmp_path / "b.md").write_text("# Title\n\nMarkdown body.")
    (tmp_path / "c.html").write_text(
        "<html><head><style>p{}</style><script>var x = 1;</script></head>"
        "<body><h1>Heading</h1><p>First paragraph.</p><p>Second <b>bold</b> one.</p></body></html>"
    )
    (tmp_path / "d.pdf").write_bytes(minimal_pdf("Hello from a PDF page"))
    (tmp_path / "e.json").write_text(json.dumps([{"body": "json one"}, {"body": "json two"}, {"other": "x"}]))
    (tmp_path / "f.jsonl").write_text('{"body": "line one"}\n\n{"body": "line two"}\n')
    with pytest.warns(LoaderWarning, match="no text in field 'body'"):  # e.json's third record
        docs = {d.label: d for d in load([tmp_path], field_name="body")}
    assert sorted(docs) == ["a.txt", "b.md", "c.html", "d.pdf", "e.json[0]", "e.json[1]", "f.jsonl:1", "f.jsonl:3"]
    assert text_of(docs["a.txt"]) == "Plain text.\nSecond line."
    assert "Markdown body." in text_of(docs["b.md"])
    html = text_of(docs["c.html"])
    assert "First paragraph." in html and "bold" in html and "var x" not in html and "p{}" not in html
    assert "Hello from a PDF page" in text_of(docs["d.pdf"])
    assert (text_of(docs["e.json[0]"]), text_of(docs["e.json[1]"])) == ("json one", "json two")  # a document per record
    assert (text_of(docs["f.jsonl:1"]), text_of(docs["f.jsonl:3"])) == ("line one", "line two")
    assert docs["a.txt"].label == "a.txt" and docs["a.txt"].source == str((tmp_path / "a.txt").resolve())


def test_directories_are_walked_recursively_and_hidden_files_ignored(tmp_path: Path) -> None:
    (tmp_path / "x" / "y").mkdir(parents=True)
    (tmp_path / "x" / "y" / "deep.txt").write_text("deep")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD.txt").write_text("ref")
    (tmp_path / "top.md").write_text("top")
    labels = [d.label for d in load([tmp_path])]
    assert labels == ["top.md", "x/y/deep.txt"]


def test_skips_warn_once_each_and_summarise(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "empty.txt").write_text("")
    latin = "Le café est fermé le lundi. La crème brûlée coûte sept euros, très cher pour un dessert à Genève."
    (tmp_path / "latin.txt").write_bytes(latin.encode("latin-1"))
    (tmp_path / "bin.txt").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "pic.png").write_bytes(b"\x89PNG")
    (tmp_path / "broken.pdf").write_bytes(b"%PDF-1.4 nonsense")
    report = LoadReport()
    with pytest.warns(LoaderWarning) as caught:
        docs = list(load([tmp_path], report=report))
    # not UTF-8: read in the encoding detected, and the one warning says which
    assert [Path(d.source).name for d in docs] == ["latin.txt", "ok.txt"] and "".join(docs[0].blocks()).startswith("Le café est fermé")  # a guess: rarer letters may differ
    # a file of another type found in the walk is counted, not warned: a site's assets would be hundreds
    assert len(caught) == len(report.skipped) == 4
    assert any("latin.txt: not UTF-8; read as" in str(w.message) for w in caught)
    assert not any("pic.png" in str(w.message) for w in caught)
    why = {Path(s).name: w for s, w in report.skipped}
    assert why["empty.txt"] == "empty file"
    assert why["bin.txt"] == "binary file" and why["pic.png"] == "unsupported type: .png"
    assert why["broken.pdf"].startswith("unreadable PDF")
    assert report.summary() == ("skipped 4 file(s) or record(s): 1 binary file, 1 empty file, "
                                "1 unreadable PDF, 1 unsupported type (.png 1)")


def test_a_walk_counts_other_types_by_extension_and_a_file_passed_by_name_is_warned(tmp_path: Path) -> None:
    (tmp_path / "page.html").write_text("<html><body><p>The gate opens at nine.</p></body></html>")
    for name in ("a.css", "b.css", "c.js", "logo.png", "LICENSE"):
        (tmp_path / name).write_text("x")
    report = LoadReport()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoaderWarning)  # none of the walk's skips warns
        assert [d.label for d in load([tmp_path], report=report)] == ["page.html"]
    assert report.summary() == ("skipped 5 file(s) or record(s): 5 unsupported type "
                                "(.css 2, .js 1, .png 1, no extension 1)")
    with pytest.warns(LoaderWarning, match=r"logo.png: unsupported type: .png \(supported: .txt"):
        assert list(load([tmp_path / "logo.png"])) == []


def test_a_walk_skips_the_pages_a_site_marks_as_copies_and_a_file_passed_by_name_is_read(tmp_path: Path) -> None:
    # mdBook's print.html is the whole book on one page, marked noindex; Sphinx keeps each page's source in
    # _sources/ beside its HTML: read both and every passage is in the corpus twice
    chapter = "<html><head><title>Gate</title></head><body><p>The gate opens at nine.</p></body></html>"
    (tmp_path / "gate.html").write_text(chapter)
    (tmp_path / "print.html").write_text('<html><head><META content="noindex, nofollow" name=robots></head>'
                                         "<body><p>The gate opens at nine.</p></body></html>")
    (tmp_path / "indexed.html").write_text('<html><head><meta name="robots" content="index, follow"></head>'
                                           "<body><p>The bell rings at ten.</p></body></html>")
    (tmp_path / "_sources" / "api").mkdir(parents=True)
    (tmp_path / "api").mkdir()
    (tmp_path / "api" / "fs.html").write_text(chapter.replace("gate opens", "file system mounts"))
    (tmp_path / "_sources" / "api" / "fs.rst.txt").write_text("The file system mounts at nine.")
    (tmp_path / "_sources" / "orphan.md.txt").write_text("A source with no page of its own is read.")
    report = LoadReport()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LoaderWarning)  # none of the walk's skips warns
        labels = [d.label for d in load([tmp_path], report=report)]
    assert labels == ["_sources/orphan.md.txt", "api/fs.html", "gate.html", "indexed.html"]
    assert report.summary() == "skipped 2 file(s) or record(s): 1 Sphinx source copy, 1 noindex page"
    assert [d.label for d in load([tmp_path / "print.html"])] == ["print.html"]  # asked for by name: read


def test_missing_path_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file"):
        list(load([tmp_path / "missing.txt"]))


def test_framework_objects_by_duck_typing() -> None:
    class LangChainDocument:
        page_content = "from langchain"
        metadata = {"source": "lc.txt"}

    class LlamaIndexNode:
        id_ = "node-1"
        metadata: dict = {}

        def get_content(self) -> str:
            return "from llamaindex"

    lc, li = load([LangChainDocument(), LlamaIndexNode()])
    assert (lc.source, text_of(lc)) == ("lc.txt", "from langchain")
    assert (li.source, text_of(li)) == ("node-1", "from llamaindex")
    with pytest.raises(ValueError, match="cannot load a int"):
        list(load([42]))


def test_hash_changes_with_content_only(tmp_path: Path) -> None:
    f = tmp_path / "a.txt"
    f.write_text("one")
    h1 = next(load([f])).content_hash
    assert next(load([f])).content_hash == h1
    f.write_text("two")
    assert next(load([f])).content_hash != h1


def test_large_file_streams_in_bounded_memory(tmp_path: Path) -> None:
    big = tmp_path / "big.txt"
    line = "Streaming keeps memory bounded no matter how large the file is.\n"
    with big.open("w") as f:
        for _ in range(48):
            f.write(line * (2**20 // len(line)))  # ~48 MB
    tracemalloc.start()
    doc = next(load([big]))
    total = sum(len(block) for block in doc.blocks())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert total > 45 * 2**20
    assert peak < 12 * 2**20, f"{peak=}"


def test_a_broken_pdf_gives_one_warning_and_no_parser_noise(tmp_path: Path, caplog) -> None:
    (tmp_path / "picture.pdf").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))  # a PNG named .pdf
    with caplog.at_level(logging.DEBUG), pytest.warns(LoaderWarning) as caught:
        assert list(load([tmp_path])) == []
    assert len(caught) == 1 and "unreadable PDF" in str(caught[0].message)
    assert [r.getMessage() for r in caplog.records if r.name.startswith("pypdf")] == []
