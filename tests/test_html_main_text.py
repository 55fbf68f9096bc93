"""Clean text at ingest: an HTML page's main text as Markdown (furniture dropped; headings, code, tables
and lists kept), PDF running headers and footers, and the bad input of either: a page with nothing but
navigation, a page in another language, a huge table."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

from rag_promptcache.rag.html import is_navigation, main_text
from rag_promptcache.rag.ingestor import NO_MAIN_TEXT
from rag_promptcache.rag.loaders import LoaderWarning, load, pdf_pages
from tests.test_rag_corpus import FakeEmbedder, FakeEngine
from rag_promptcache.rag.corpus import Corpus

# The furniture of the documentation generators this machine's manuals come from: a site menu (sqlite.org),
# DocBook's navheader table, texinfo's nav-panel, Sphinx's related bar and sidebar, a local table of contents.
PAGE = """<!DOCTYPE html><html><head><title>Write-Ahead Logging</title><style>p {color: red}</style></head><body>
<div class="nosearch"><div class="tagline">Small. Fast. Reliable.</div>
  <div class="menu mainmenu"><ul><li><a href="index.html">Home</a></li><li><a href="about.html">About</a></li>
  <li><a href="docs.html">Documentation</a></li><li><a href="download.html">Download</a></li></ul></div></div>
<div class="navheader"><table><tr><td><a href="a.html">Prev</a></td><td>Chapter 2</td><td><a href="c.html">Next</a></td></tr></table></div>
<div class="nav-panel"><p>Next: <a href="t.html">Types</a>, Previous: <a href="b.html">The Basics</a>, Up: <a href="u.html">Using</a></p></div>
<div class="related" role="navigation"><ul><li><a href="genindex.html">index</a></li><li><a href="py-modindex.html">modules</a></li></ul></div>
<div class="fancy_toc"><ul><li><a href="#overview">1. Overview</a></li><li><a href="#how">2. How WAL Works</a></li>
  <li><a href="#cp">2.1. Checkpointing</a></li></ul></div>
<h1 id="overview">1. Overview</h1>
<p>The default method by which SQLite implements atomic commit is a <a href="rbj.html">rollback journal</a>.</p>
<h2 id="cp">2.1. Checkpointing</h2>
<p>By default, SQLite does a checkpoint automatically when the WAL file reaches a threshold size of 1000 pages.</p>
<pre>PRAGMA wal_autocheckpoint=1000;
PRAGMA journal_mode=WAL;</pre>
<table><tr><th>Mode</th><th>Journal</th></tr><tr><td>DELETE</td><td>deleted at commit</td></tr></table>
<ul><li>Readers do not block writers.</li><li>Writers do not block readers.</li></ul>
<p><a href="prev.html">Prev</a> | <a href="index.html">Home</a> | <a href="next.html">Next</a></p>
<div id="footer"><div id="footer-text">Last updated 2023-01-01</div></div>
<div class="sphinxsidebar"><h3>Quick search</h3><form><input type="text"></form></div>
</body></html>"""


def test_furniture_goes_and_headings_code_tables_lists_stay() -> None:
    page = main_text(PAGE)
    text = page.text
    assert page.title == "Write-Ahead Logging"
    for gone in ("Small. Fast", "Download", "Prev", "Next:", "The Basics", "py-modindex", "genindex", "Last updated",
                 "Quick search", "2. How WAL Works", "color: red"):
        assert gone not in text, gone
    assert "# 1. Overview" in text and "## 2.1. Checkpointing" in text
    assert "threshold size of 1000 pages" in text and "rollback journal." in text  # a link's text stays in prose
    assert "```\nPRAGMA wal_autocheckpoint=1000;\nPRAGMA journal_mode=WAL;\n```" in text
    assert "| DELETE | deleted at commit |" in text
    assert "- Readers do not block writers." in text


def test_navigation_lines() -> None:
    assert all(is_navigation(x) for x in ("Prev | Up | Next", "[Index]", "Home", "« Previous  Next »", "Table of Contents"))
    assert not any(is_navigation(x) for x in ("Next, run the updater.", "Up to 64 tables", "index = 3", ""))


def test_a_page_with_nothing_but_navigation_is_skipped_with_a_warning(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    links = "".join(f'<li><a href="p{i}.html">Chapter {i}</a></li>' for i in range(30))
    (docs / "index.html").write_text(f"<html><head><title>Contents</title></head><body><ul>{links}</ul></body></html>")
    (docs / "page.html").write_text("<html><body><h1>Owls</h1><p>Owls hunt voles at night.</p></body></html>")
    assert main_text((docs / "index.html").read_text()).text == ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = Corpus.build([docs], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), progress=False)
    said = [str(w.message) for w in caught if issubclass(w.category, LoaderWarning)]
    assert any("index.html" in s and NO_MAIN_TEXT in s for s in said)
    assert (str((docs / "index.html").resolve()), NO_MAIN_TEXT) in c.last_report.skipped
    assert len(c) == 1 and "voles" in c.text(c.search("voles", k=1)[0][0])
    c.close()


def test_pages_in_other_languages_keep_their_text_and_are_found(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "de.html").write_text("<html lang='de'><head><title>Größe</title></head><body><h1>Speicher</h1>"
                                  "<p>Die maximale Größe einer Datenbank beträgt 281 Terabyte.</p></body></html>",
                                  encoding="utf-8")
    (docs / "zh.html").write_text("<html lang='zh'><head><title>数据库</title></head><body><h1>日志</h1>"
                                  "<p>预写日志模式允许读者和写者同时工作。</p></body></html>", encoding="utf-8")
    (docs / "en.html").write_text("<html><body><p>Owls hunt voles at night.</p></body></html>")
    c = Corpus.build([docs], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), progress=False)
    assert "281 Terabyte" in c.text(c.search("Wie groß darf eine Datenbank sein? Größe", k=1)[0][0])
    assert c.source(c.search("预写日志", k=1, mode="lexical")[0][0]).endswith("zh.html")
    assert c.search("什么是预写日志模式？", k=2)  # hybrid: no error whatever the script
    c.close()


def test_a_huge_table_is_kept_and_chunked_in_bounded_time(tmp_path: Path) -> None:
    rows = "".join(f"<tr><td>setting_{i}</td><td>{i * 7}</td><td>row {i} of the table</td></tr>" for i in range(3000))
    html = f"<html><head><title>Settings</title></head><body><h1>All settings</h1><table>{rows}</table></body></html>"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "big.html").write_text(html)
    t0 = time.monotonic()
    text = main_text(html).text
    assert text.count("\n| setting_") == 3000 and "| setting_2999 | 20993 |" in text
    c = Corpus.build([tmp_path / "docs"], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(),
                     chunk_tokens=128, progress=False)
    assert len(c) > 20
    hit = c.search("setting_2999", k=1, mode="lexical")[0][0]
    assert "20993" in c.text(hit)
    assert c.table.db.execute("SELECT DISTINCT context FROM modules").fetchall() == [("Settings › All settings",)]
    assert time.monotonic() - t0 < 300  # seconds, not the quadratic blow-up of re-counting the table per row
    c.close()


def test_pdf_running_headers_footers_and_page_numbers_go() -> None:
    pages = [f"SQLite Manual — Chapter 3\nPage {i} of 9\nBody text number {i} about journals.\nMore prose here.\n"
             f"Copyright 2024 SQLite Consortium\n{i}" for i in range(1, 10)]
    out = pdf_pages(pages)
    assert len(out) == 9 and all("Chapter 3" not in p and "Copyright" not in p and "Page " not in p for p in out)
    assert out[4] == "Body text number 5 about journals.\nMore prose here."
    assert pdf_pages(["Only page\nwith text", ""]) == ["Only page\nwith text"]  # one page: nothing recurs


def test_html_documents_carry_their_title(tmp_path: Path) -> None:
    (tmp_path / "a.html").write_text("<html><head><title>The &amp; Guide</title></head><body><p>Hi there.</p></body></html>")
    (tmp_path / "b.md").write_text("Intro line\n\n# Real Title\n\nText.\n")
    (tmp_path / "c.txt").write_text("# not a heading in plain text\n")
    docs = {d.label: d for d in load([tmp_path])}
    assert docs["a.html"].title == "The & Guide" and docs["b.md"].title == "Real Title" and docs["c.txt"].title == ""
    assert docs["a.html"].headings and docs["b.md"].headings and not docs["c.txt"].headings
