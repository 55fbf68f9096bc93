"""When an answer repeats itself: the default repetition control every entry point shares.

- `DEFAULT_NO_REPEAT_NGRAM`: no run of this many tokens is generated twice (the engine's
  `Sampling.no_repeat_ngram`). The small default model can repeat a sentence until max_new_tokens;
  this stops the verbatim loop and leaves ordinary answers as they were (docs/limits.md).
- `repeated_sentence(text)`: a whole sentence that repeats an earlier one word for word ends the
  answer, before the repeat. It is a pure function of the text decoded so far, called after each
  token like a stop-string check: `Repeat.cut` is where to end, `Repeat.safe` how much may be
  streamed now (a sentence still growing into an earlier one is held back, so the repeat is never
  shown). The n-gram ban alone lets a loop through with one token changed; this catches the loops
  it lets through only when they are exact, and is cheap (one pass over an answer of a few KB).

`answer_options(sampling)` puts both over a caller's options, the one place they are applied: what
`Corpus.ask` (and so `ask`, `chat`, `eval`) and the adapters (`rag.prompts.generation_options`) pass
the engine.

Out of scope: tokens and logits (the engine's), near-repeats (paraphrases), and which requests get
these defaults (the callers: Corpus.ask, the adapters, the server).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

DEFAULT_NO_REPEAT_NGRAM = 6
# A repeat this short ("Yes.", "1. Paris") is ordinary text, not a loop.
MIN_REPEATED_WORDS = 4
# A sentence ends at . ! ? followed by white space, or at a line break (list items, lines of a table).
_BOUNDARY = re.compile(r"(?<=[.!?])[ \t]+|[ \t]*\n\s*")


class Repeat(NamedTuple):
    cut: int | None  # end the answer at text[:cut]; None: no whole sentence repeated yet
    safe: int  # text[:safe] may be emitted now; the rest could still become a repeat


def repeated_sentence(text: str, final: bool = False) -> Repeat:
    """Whether a complete sentence of `text` repeats an earlier one word for word (cut before the
    first such, trailing white space dropped), and how much of `text` cannot turn into such a repeat.
    `final`: the answer ended (EOS, max_new_tokens), so its unfinished last sentence is complete."""
    spans: list[tuple[int, int]] = []  # complete sentences: (start, end), each followed by a boundary
    start = 0
    for m in _BOUNDARY.finditer(text):
        if m.start() > start:
            spans.append((start, m.start()))
        start = m.end()
    if final and text[start:].strip():
        spans.append((start, len(text.rstrip())))
        start = len(text)
    earlier: set[str] = set()
    for a, b in spans:  # the first sentence that repeats an earlier one (the last, when streaming)
        if len(text[a:b].split()) < MIN_REPEATED_WORDS:
            continue
        if text[a:b] in earlier:
            keep = len(text[:a].rstrip())
            return Repeat(keep, keep)
        earlier.add(text[a:b])
    tail = text[start:]  # the sentence still being written
    if tail and any(s.startswith(tail) for s in earlier):
        return Repeat(None, len(text[:start].rstrip()) if start else 0)
    return Repeat(None, len(text))


def answer_options(sampling: Mapping[str, object]) -> dict[str, object]:
    """`sampling` (engine keyword arguments) with the repetition control every answer path shares:
    `no_repeat_ngram` defaults to DEFAULT_NO_REPEAT_NGRAM (0 is off), and the answer ends before a
    repeated sentence (`stop_when=repeated_sentence`) unless `stop_repeats=False`, which is consumed,
    or the answer is JSON (`response_format`)."""
    out = dict(sampling)
    out.setdefault("no_repeat_ngram", DEFAULT_NO_REPEAT_NGRAM)
    # a JSON answer is ended by its grammar: cut at a repeated sentence it would not parse, and the
    # n-gram ban stops its loops (the grammar wins where it allows nothing else)
    if out.pop("stop_repeats", True) and not _is_json(out.get("response_format")):
        out.setdefault("stop_when", repeated_sentence)
    return out


def _is_json(response_format: object) -> bool:
    """Whether a `response_format` (a ResponseFormat, an OpenAI dict or None) asks for JSON."""
    if response_format is None:
        return False
    return not (isinstance(response_format, Mapping) and response_format.get("type") == "text")
