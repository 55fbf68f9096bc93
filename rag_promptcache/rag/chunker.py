"""Split a document's text stream into token-bounded chunks with stable, content-derived ids.

Counting uses the LLM's own tokenizer (anything with `encode(text, add_special_tokens=False)`),
because a chunk becomes a prompt module and its length in *that* model's tokens is what costs KV.
Chunks prefer paragraph, then sentence, then word boundaries; a chunk's text is always an exact
slice `text[start:end]` of the document. The module a chunk becomes (header + text) never exceeds
`max_tokens`. Memory stays bounded: text is consumed block by block.

Markdown headings (`# ...`, outside fenced code; HTML pages arrive as Markdown, `html.py`) are followed:
a new section starts a new chunk unless the one open is still short, no overlap is carried across
it, and each chunk records its context: the document's title and the heading path it sits under
("SQLite Autoincrement › 3. The AUTOINCREMENT Keyword"), which retrieval reads with the text
(`search_text`) and the model reads as the module's first line (MODULE_HEADER).

Not here: where text comes from (`loaders.py`) or which chunks are new (`corpus.py`).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

_PARAGRAPH_END = re.compile(r"\n[ \t]*\n\s*")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+|\n\s*")
_WORD = re.compile(r"\s*\S+\s*")
_FORCE_FLUSH_CHARS = 1 << 22  # a "paragraph" this long with no blank line is cut at a sentence
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
_FENCE = re.compile(r"^\s*(?:>\s*)*```", re.M)
SEPARATOR = " › "  # between the title and the headings of a chunk's context
MAX_CONTEXT_CHARS = 200  # a longer heading path keeps its title and its innermost headings
SECTION_FLUSH = 4  # at a heading, the open chunk is emitted when it holds at least 1/SECTION_FLUSH of a chunk
# What a module's text starts with: the document's label ("[guide/intro.md]"), the chunk's context
# (title and heading path; the label where there is none), or nothing. "context", measured on 63
# questions about SQLite's and Git's HTML manuals (k = 4, hybrid retrieval, the shipped default): the
# cached path answered 33 right against 26 with the label and 29 with nothing, full prefill 31 against
# 29 and 30, and no answer copied a label, context line or navigation in any (docs/retrieval.md). A
# document without a title or headings reads as before: its context is its label.
MODULE_HEADERS = ("label", "context", "none")
MODULE_HEADER = "context"


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class ChunkParams:
    chunk_tokens: int = 256  # target module length, label included
    overlap: int = 32  # tokens of trailing text repeated at the start of the next chunk (at most)
    max_tokens: int | None = None  # hard maximum; default chunk_tokens + chunk_tokens // 4

    def __post_init__(self) -> None:
        if self.chunk_tokens < 16:
            raise ValueError(f"chunk_tokens must be at least 16, got {self.chunk_tokens}")
        if not 0 <= self.overlap <= self.chunk_tokens // 2:
            raise ValueError(f"overlap must be between 0 and chunk_tokens/2 ({self.chunk_tokens // 2}), got {self.overlap}")
        if self.max_tokens is not None and self.max_tokens < self.chunk_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be at least chunk_tokens ({self.chunk_tokens})")

    @property
    def hard_max(self) -> int:
        return self.max_tokens if self.max_tokens is not None else self.chunk_tokens + self.chunk_tokens // 4


@dataclass(frozen=True, slots=True)
class Chunk:
    module_id: str
    text: str  # document[start:end]
    module_text: str  # what the prompt module holds: source label + text
    start: int
    end: int
    num_tokens: int  # of module_text
    context: str = ""  # the document's title and the headings the chunk sits under, joined by SEPARATOR


def module_text(label: str, text: str) -> str:
    body = text.strip()
    return f"[{label}]\n{body}\n\n" if label else f"{body}\n\n"


def search_text(context: str, module: str) -> str:
    """What retrieval reads of a module, the dense embedding and the lexical index alike: its context
    line (title and headings), then its text."""
    return f"{context}\n{module}" if context else module


def context_of(title: str, headings: list[str]) -> str:
    """A chunk's context: the title, then the heading path (a first heading that repeats the title
    dropped), shortened from the outside in to MAX_CONTEXT_CHARS."""
    parts = [p for p in [title, *headings] if p]
    if len(parts) > 1 and parts[1].lower().startswith(parts[0].lower()):
        parts.pop(1)
    while len(parts) > 2 and len(SEPARATOR.join(parts)) > MAX_CONTEXT_CHARS:
        parts.pop(1)
    return SEPARATOR.join(parts)[:MAX_CONTEXT_CHARS]


def module_id(text: str) -> str:
    """A valid PML tag name derived from the module text alone: same text, same id, any machine."""
    return "m" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(slots=True)
class _Unit:
    start: int
    text: str
    num_tokens: int


class Chunker:
    def __init__(self, tokenizer: Tokenizer, params: ChunkParams = ChunkParams()) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._overheads: dict[str, int] = {}  # tokens a module header costs, by header

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def chunks(self, blocks: Iterable[str], label: str = "", *, title: str = "", headings: bool = False) -> Iterator[Chunk]:
        """Chunks of the text that `blocks` concatenate to, in order, identical ones dropped. With
        `headings`, Markdown headings open sections and name each chunk's context under `title`."""
        seen: set[str] = set()
        window: list[_Unit] = []
        path: list[tuple[int, str]] = []  # (level, heading) of the section being read
        context = context_of(title, [])
        fenced = False
        for offset, paragraph in _paragraphs(blocks):
            heading = None if fenced or not headings else _HEADING.match(paragraph.strip())
            fenced ^= len(_FENCE.findall(paragraph)) % 2 == 1
            if heading is not None and "\n" not in paragraph.strip():
                level = len(heading.group(1))
                path = [(lv, h) for lv, h in path if lv < level] + [(level, heading.group(2).strip())]
                if window and sum(u.num_tokens for u in window) * SECTION_FLUSH >= self.params.chunk_tokens:
                    yield from self._emit(window, self._header(label, context), context, seen)
                    window = []
                if not window:
                    context = context_of(title, [h for _, h in path])
            target = self._target(self._header(label, context), label)
            for unit in self._units(offset, paragraph, target):
                if window and sum(u.num_tokens for u in window) + unit.num_tokens > target:
                    yield from self._emit(window, self._header(label, context), context, seen)
                    window = self._carry(window, unit.num_tokens, target)
                    context = context_of(title, [h for _, h in path])
                window.append(unit)
        if window and any(u.text.strip() for u in window):
            yield from self._emit(window, self._header(label, context), context, seen)

    @staticmethod
    def _header(label: str, context: str) -> str:
        return {"label": label, "context": context or label, "none": ""}[MODULE_HEADER]

    def _target(self, header: str, label: str) -> int:
        """Tokens of text a chunk may hold beside its header."""
        if header not in self._overheads:
            self._overheads[header] = self.count(module_text(header, "x")) - 1
        target = self.params.chunk_tokens - self._overheads[header]
        if target < 8:
            raise ValueError(f"source label {label!r} leaves only {target} tokens of a {self.params.chunk_tokens}-token chunk")
        return target

    def _carry(self, window: list[_Unit], incoming: int, target: int) -> list[_Unit]:
        """The trailing units (≤ overlap tokens) that open the next chunk, leaving room for `incoming`."""
        carried: list[_Unit] = []
        total = 0
        for unit in reversed(window):
            if total + unit.num_tokens > self.params.overlap or total + unit.num_tokens + incoming > target:
                break
            carried.insert(0, unit)
            total += unit.num_tokens
        return carried

    def _units(self, offset: int, text: str, target: int) -> Iterator[_Unit]:
        """Pieces of at most `target` tokens: the paragraph, else its sentences, else words, else cuts."""
        # Cheap guard: a piece this many characters long cannot fit, so skip counting it.
        n = self.count(text) if len(text) <= target * 12 else target + 1
        if n <= target:
            if text.strip():
                yield _Unit(offset, text, n)
            elif text:
                yield _Unit(offset, text, 0)
            return
        for pattern in (_SENTENCE_END, _WORD):
            pieces = _split(text, pattern)
            if len(pieces) > 1:
                for start, piece in pieces:
                    yield from self._units(offset + start, piece, target)
                return
        yield from self._cut(offset, text, target)

    def _cut(self, offset: int, text: str, target: int) -> Iterator[_Unit]:
        """A single over-long word (a hash, a URL): the longest prefixes that fit, by bisection."""
        start = 0
        while start < len(text):
            lo, hi = 1, len(text) - start
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.count(text[start : start + mid]) <= target:
                    lo = mid
                else:
                    hi = mid - 1
            piece = text[start : start + lo]
            yield _Unit(offset + start, piece, self.count(piece))
            start += lo

    def _emit(self, window: list[_Unit], header: str, context: str, seen: set[str]) -> Iterator[Chunk]:
        text = "".join(u.text for u in window)
        if not text.strip():
            return
        mtext = module_text(header, text)
        n = self.count(mtext)
        if n > self.params.hard_max:
            # Token merges across unit seams made the whole longer than its parts; split and retry.
            if len(window) > 1:
                half = len(window) // 2
                yield from self._emit(window[:half], header, context, seen)
                yield from self._emit(window[half:], header, context, seen)
            else:
                unit = window[0]
                for piece in self._cut(unit.start, unit.text, max(8, unit.num_tokens // 2)):
                    yield from self._emit([piece], header, context, seen)
            return
        mid = module_id(mtext)
        if mid in seen:
            return
        seen.add(mid)
        start = window[0].start
        yield Chunk(mid, text, mtext, start, start + len(text), n, context)


def _split(text: str, pattern: re.Pattern[str]) -> list[tuple[int, str]]:
    """`text` cut after each match of `pattern`; the pieces concatenate back to `text`."""
    cuts = [m.end() for m in pattern.finditer(text) if 0 < m.end() < len(text)]
    bounds = [0, *cuts, len(text)]
    return [(a, text[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]


def _paragraphs(blocks: Iterable[str]) -> Iterator[tuple[int, str]]:
    """(offset, paragraph with its trailing blank lines) across block boundaries."""
    buffer = ""
    offset = 0
    for block in blocks:
        buffer += block
        cut = 0
        for m in _PARAGRAPH_END.finditer(buffer):
            if m.end() == len(buffer):
                break  # the blank run may continue in the next block
            yield offset + cut, buffer[cut : m.end()]
            cut = m.end()
        if cut == 0 and len(buffer) > _FORCE_FLUSH_CHARS:
            ends = [m.end() for m in _SENTENCE_END.finditer(buffer) if m.end() < len(buffer)]
            cut = ends[-1] if ends else len(buffer)
            yield offset, buffer[:cut]
        buffer = buffer[cut:]
        offset += cut
    if buffer:
        yield offset, buffer
