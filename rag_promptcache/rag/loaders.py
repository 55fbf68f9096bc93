"""Turn paths and in-memory documents into `Document`s whose text is read lazily, in blocks.

Plain text, Markdown, JSON Lines stream with bounded memory (one block or one line at a time);
HTML, PDF and whole-file JSON are read per file. HTML becomes its main text as Markdown (`html.py`:
navigation, tables of contents, headers and footers dropped); PDF pages lose the running headers and
footers they repeat and their page numbers (`pdf_pages`). Each document has a title where it names
one (HTML `<title>`, a Markdown file's first `# ` heading, a PDF's metadata). A Markdown file's YAML
front matter (between `---` lines at its start) is its metadata, as a record's other fields are a
record's, and an object's `metadata` is its own; each file's modification time is kept. A text or HTML file that is not UTF-8 is read in the
encoding `charset-normalizer` detects, with one warning naming it (JSON must be UTF-8). PDF parser
messages about a broken file are silenced: the one warning that skips the file says it. LangChain `Document`s and LlamaIndex nodes are
accepted by duck typing (`page_content`/`metadata`, `get_content()`/`metadata`): the frameworks are
never imported here. Not here: chunking, deduplication, deciding what changed (see `corpus.py`).
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import html as html_lib
import json
import logging
import os
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from rag_promptcache.rag.html import main_text
from rag_promptcache.rag.records import skip_summary
from rag_promptcache.rag.records_loader import record_documents

MAX_CHAOS = 0.05  # charset-normalizer's mess ratio past which a guessed encoding is rejected
BLOCK_CHARS = 1 << 20  # how much text a streaming reader hands on at a time
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst", ".text")
SUFFIXES = (*TEXT_SUFFIXES, ".html", ".htm", ".pdf", ".json", ".jsonl")
# Part of an HTML file's hash: a page read by another extraction is read again on the next ingest.
HTML_EXTRACTION = "html-main-text-1"
TITLE_CHARS = 1 << 16  # how much of a file's start is searched for its title
EDGE_LINES = 2  # lines at each edge of a PDF page that may be a running header or footer
RUNNING_SHARE = 0.5  # ... when they recur on at least this share of the pages
_HTML_TITLE = re.compile(r"<title[^>]*>(.*?)</title>", re.I | re.S)
_FRONT_MATTER = re.compile(r"\A\ufeff?---[ \t]*\r?\n(.*?)\r?\n(?:---|\.\.\.)[ \t]*(?:\r?\n|\Z)", re.S)
_NOINDEX = re.compile(r"""<meta\s(?=[^>]*\bname\s*=\s*["']?robots\b)[^>]*\bcontent\s*=\s*["'][^"']*\bnoindex\b""", re.I)
_MD_TITLE = re.compile(r"^#[ \t]+(.+?)[ \t#]*$", re.M)
_PAGE_NUMBER = re.compile(r"^\s*(?:page\s+)?[-–—(\[]?\s*\d{1,5}\s*[-–—)\]]?(?:\s*(?:of|/)\s*\d{1,5})?\s*$", re.I)


class LoaderWarning(UserWarning):
    """A file skipped during loading, or read in an encoding other than UTF-8; one per file."""


@dataclass(frozen=True, slots=True)
class Document:
    """One source. `blocks()` yields its text in pieces whose concatenation is the whole text."""

    source: str  # where it was read: a resolved path (records: `<path>#<id>`), or an id given in metadata
    label: str  # what the model sees: a path relative to what was passed, or the file name
    content_hash: str  # of the raw bytes (or text) plus loader options: unchanged hash = nothing to do
    blocks: Callable[[], Iterator[str]] = field(repr=False)
    num_bytes: int = 0
    kind: str = "text"
    metadata: dict[str, object] = field(default_factory=dict, compare=False)  # a record's other fields
    # Its identity in a corpus: the path relative to what was passed (a file passed by itself: its
    # name; a record: `<that>#<id>`), an object's id. A corpus keeps one document per name, so the
    # same documents ingested from a copied folder replace the earlier ones. "" means the label.
    name: str = ""
    title: str = ""  # what the document calls itself; "" when it names nothing (the label stands in)
    modified: float | None = None  # the file's modification time (epoch seconds); None for an object

    @property
    def headings(self) -> bool:
        """Whether its text marks sections with Markdown headings (the chunker follows them)."""
        return self.kind in ("md", "markdown", "html", "htm")

    @property
    def identity(self) -> str:
        return self.name or self.label


@dataclass(slots=True)
class LoadReport:
    """What `load` skipped and why, for the summary line at the end of an ingest."""

    skipped: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)

    def summary(self) -> str:
        return skip_summary(self.skipped)


def load(
    items: Iterable[str | os.PathLike[str] | object],
    *,
    field_name: str = "text",
    id_field: str = "id",
    report: LoadReport | None = None,
) -> Iterator[Document]:
    """Documents for paths (files or directories, walked recursively in sorted order) and for
    LangChain/LlamaIndex objects; each record of a .jsonl/.json file is a document of its own
    (`records_loader.py`). A missing path raises `FileNotFoundError`; files (and records) that
    cannot be read are skipped with one `LoaderWarning` each and recorded in `report`; files of
    other types found in a directory, and pages its site marks as copies (`_site_copy`), are recorded without a
    warning (`report.summary()` counts them)."""
    report = report if report is not None else LoadReport()
    for item in items:
        if isinstance(item, (str, os.PathLike)):
            path = Path(item)
            if not path.exists():
                raise FileNotFoundError(f"no such file or directory: {path}")
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            for file in files:
                if path.is_dir() and any(p.startswith(".") for p in file.relative_to(path).parts):
                    continue  # .git, .DS_Store and friends
                label = file.relative_to(path).as_posix() if path.is_dir() else file.name
                if file.suffix.lower() in (".json", ".jsonl"):
                    if _readable(file, report):
                        yield from record_documents(file, label, field_name, id_field, lambda where, why: _skip(report, where, why),
                                                    functools.partial(Document, modified=file.stat().st_mtime))
                    continue
                if path.is_dir() and file.suffix.lower() not in SUFFIXES:
                    # a site's stylesheets, scripts and images: counted in the summary, not warned one by one
                    report.skipped.append((str(file), f"unsupported type: {file.suffix.lower() or 'no extension'}"))
                    continue
                if path.is_dir() and (copy := _site_copy(file)):
                    report.skipped.append((str(file), copy))  # counted, not warned: the site says it repeats
                    continue
                doc = _load_file(file, label, field_name, report)
                if doc is not None:
                    yield doc
        else:
            doc = _from_object(item)
            if doc.num_bytes and "".join(doc.blocks()).strip():
                yield doc
            else:
                _skip(report, doc.source, "empty document")


SITE_COPIES = ("noindex page", "Sphinx source copy")  # what `_site_copy`'s reasons start with


def is_site_copy(why: str) -> bool:
    """Whether a skip's reason says the site marks the file as a copy of pages the walk reads (`_site_copy`)."""
    return why.partition(":")[0] in SITE_COPIES


def _site_copy(file: Path) -> str:
    """Why a file found in a directory walk repeats pages the walk also reads, or '': an HTML page that
    asks search engines not to index it (`<meta name="robots" content="noindex">`: mdBook's print.html, the
    whole book on one page; search and redirect pages), or the copy of a page's source a Sphinx build keeps
    beside its HTML (`_sources/usage.rst.txt` of `usage.html`). Either would put every passage in the corpus
    twice, and two copies of one passage take two of a question's k. A file passed by name is read."""
    suffix = file.suffix.lower()
    if suffix in (".html", ".htm"):
        with file.open("rb") as f:
            head = f.read(TITLE_CHARS).decode("utf-8", "replace")
        return f"{SITE_COPIES[0]}: the site marks it a copy (print, search or redirect page)" if _NOINDEX.search(head) else ""
    if suffix == ".txt" and "_sources" in file.parts[:-1]:
        at = len(file.parts) - 1 - file.parts[::-1].index("_sources")  # the nearest _sources above the file
        page = Path(*file.parts[:at], *file.parts[at + 1:]).with_suffix("")  # _sources/a/b.rst.txt -> a/b.rst
        if page.with_suffix(".html").is_file():
            return f"{SITE_COPIES[1]}: its HTML page is read"
    return ""


def _skip(report: LoadReport, source: Path | str, reason: str) -> None:
    report.skipped.append((str(source), reason))
    warnings.warn(f"skipping {source}: {reason}", LoaderWarning, stacklevel=3)


def _readable(path: Path, report: LoadReport) -> bool:
    """Whether a file is non-empty UTF-8 (else it is reported and skipped)."""
    problem = "empty file" if path.stat().st_size == 0 else _sniff_text(path)
    if problem:
        _skip(report, path, problem)
    return not problem


def _load_file(path: Path, label: str, field_name: str, report: LoadReport) -> Document | None:
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        _skip(report, path, f"unsupported type: {suffix or 'no extension'} (supported: {', '.join(SUFFIXES)})")
        return None
    size = path.stat().st_size
    if size == 0:
        _skip(report, path, "empty file")
        return None
    encoding = "utf-8"
    if suffix != ".pdf":
        problem = _sniff_text(path)
        if problem.startswith("not UTF-8"):
            detected = _detect_encoding(path)
            if detected is None:
                _skip(report, path, f"{problem}, and no other text encoding fits")
                return None
            encoding = detected
            warnings.warn(f"{path}: not UTF-8; read as {encoding} (detected)", LoaderWarning, stacklevel=3)
        elif problem:
            _skip(report, path, problem)
            return None
    digest = _hash_file(path, HTML_EXTRACTION if suffix in (".html", ".htm") else "")
    kind = suffix.lstrip(".")
    readers: dict[str, Callable[[], Iterator[str]]] = {
        ".html": lambda: iter([_html_text(path.read_text(encoding=encoding, errors="replace"))]),
        ".htm": lambda: iter([_html_text(path.read_text(encoding=encoding, errors="replace"))]),
        ".pdf": lambda: _pdf_pages(path),
    }
    reader = readers.get(suffix, lambda: _text_blocks(path, encoding))
    title = ""
    if suffix == ".pdf":
        try:
            import pypdf

            with _quiet_pdf_parser():
                meta = pypdf.PdfReader(path).metadata
            title = " ".join(str((meta or {}).get("/Title") or "").split())
        except Exception as e:  # noqa: BLE001 - any parse failure means "not a PDF we can read"
            _skip(report, path, f"unreadable PDF: {type(e).__name__}")
            return None
    else:
        title = _title(path, suffix, encoding)
    meta = front_matter(path, encoding) if suffix in (".md", ".markdown") else {}
    return Document(str(path.resolve()), label, digest, reader, size, kind, meta, name=label, title=title,
                    modified=path.stat().st_mtime)


def _sniff_text(path: Path) -> str:
    """'' if the file decodes as UTF-8 from end to end, else why not. Streams; memory stays bounded."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    with path.open("rb") as f:
        first = True
        while chunk := f.read(BLOCK_CHARS):
            if first and b"\x00" in chunk[:8192]:
                return "binary file"
            first = False
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:
                return f"not UTF-8: invalid byte at offset {f.tell() - len(chunk) + e.start}"
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return "not UTF-8: truncated character at the end"
    return ""


def _detect_encoding(path: Path) -> str | None:
    """The text encoding `charset-normalizer` finds most plausible for a file, or None when none reads
    as text without noise (its `chaos` above MAX_CHAOS: stray bytes, not another encoding)."""
    from charset_normalizer import from_path

    best = from_path(path).best()
    return None if best is None or best.chaos > MAX_CHAOS else best.encoding


@contextlib.contextmanager
def _quiet_pdf_parser() -> Iterator[None]:
    """pypdf's own log lines about a broken file ("invalid pdf header", ...) off while it reads one."""
    logger = logging.getLogger("pypdf")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _hash_file(path: Path, extra: str = "") -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(extra.encode())
    with path.open("rb") as f:
        while chunk := f.read(BLOCK_CHARS):
            h.update(chunk)
    return h.hexdigest()


def _text_blocks(path: Path, encoding: str = "utf-8") -> Iterator[str]:
    with path.open("r", encoding=encoding, newline="") as f:
        while block := f.read(BLOCK_CHARS):
            yield block.replace("\r\n", "\n")


def _html_text(html: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bs4's "XML parsed as HTML" for XHTML pages, which parse fine
        return main_text(html).text


def _title(path: Path, suffix: str, encoding: str) -> str:
    """An HTML page's <title>, a Markdown file's first `# ` heading (read from the file's start only)."""
    if suffix not in (".html", ".htm", ".md", ".markdown"):
        return ""
    with path.open("r", encoding=encoding, errors="replace") as f:
        head = f.read(TITLE_CHARS)
    found = _HTML_TITLE.search(head) if suffix in (".html", ".htm") else _MD_TITLE.search(head)
    return " ".join(html_lib.unescape(found.group(1)).split()) if found else ""


def front_matter(path: Path, encoding: str = "utf-8") -> dict[str, object]:
    """A Markdown file's YAML front matter as a dict (dates as ISO-8601 strings); {} when it has none, or
    none that reads as a mapping."""
    with path.open("r", encoding=encoding, errors="replace") as f:
        head = f.read(TITLE_CHARS)
    found = _FRONT_MATTER.match(head)
    if found is None:
        return {}
    import yaml

    try:
        meta = yaml.safe_load(found.group(1))
    except yaml.YAMLError:
        return {}
    if not isinstance(meta, dict):
        return {}
    return json.loads(json.dumps({str(k): v for k, v in meta.items()}, default=_iso))


def _iso(value: object) -> str:
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


def _pdf_pages(path: Path) -> Iterator[str]:
    import pypdf

    with _quiet_pdf_parser():
        reader = pypdf.PdfReader(path)
        pages = [(page.extract_text() or "").strip() for page in reader.pages]
    for text in pdf_pages(pages):
        yield text + "\n\n"


def pdf_pages(pages: list[str]) -> list[str]:
    """Page texts less their running headers and footers: a line among a page's first or last
    `EDGE_LINES` that, with its digits masked, recurs at that edge on at least a `RUNNING_SHARE` of the
    pages (and on 3 or more), and a lone page number ("12", "- 12 -", "Page 12 of 40")."""
    def key(line: str) -> str:
        return re.sub(r"\d+", "#", " ".join(line.split()).lower())

    lines = [p.splitlines() for p in pages]
    counts: dict[tuple[str, str], int] = {}
    for page in lines:
        for edge, part in (("top", page[:EDGE_LINES]), ("bottom", page[-EDGE_LINES:])):
            for k in {key(line) for line in part if line.strip()}:
                counts[(edge, k)] = counts.get((edge, k), 0) + 1
    need = max(3, RUNNING_SHARE * len(pages))
    running = {ek for ek, n in counts.items() if n >= need}
    out = []
    for page in lines:
        n = len(page)
        kept = [line for i, line in enumerate(page)
                if not _PAGE_NUMBER.match(line)
                and not (i < EDGE_LINES and ("top", key(line)) in running)
                and not (i >= n - EDGE_LINES and ("bottom", key(line)) in running)]
        out.append("\n".join(kept).strip())
    return [p for p in out if p]


def _from_object(obj: object) -> Document:
    """A LangChain `Document` (page_content) or a LlamaIndex node (get_content()), duck-typed."""
    if hasattr(obj, "page_content"):
        text = str(obj.page_content)
    elif callable(getattr(obj, "get_content", None)):
        text = str(obj.get_content())  # type: ignore[attr-defined]
    elif isinstance(obj, str):
        text = obj
    else:
        raise ValueError(
            f"cannot load a {type(obj).__name__}: pass paths, strings, LangChain Documents "
            "(page_content) or LlamaIndex nodes (get_content())"
        )
    metadata = getattr(obj, "metadata", None) or {}
    digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
    source = next(
        (str(metadata[k]) for k in ("source", "file_path", "file_name", "doc_id") if metadata.get(k)),
        None,
    ) or str(getattr(obj, "id_", None) or getattr(obj, "id", None) or f"doc-{digest[:12]}")
    own = json.loads(json.dumps({str(k): v for k, v in metadata.items()}, default=_iso))
    return Document(source, source, digest, lambda: iter([text]), len(text.encode()), "object", own)
