"""One output style for the inspecting commands (`info`, `store info`): an aligned two-column table
for people, or `--json` (one object) for scripts; and the mark under an answer the token budget cut
off or left empty (`ask`, `chat`, `demo`); the sources under an answer. Formatting only."""

from __future__ import annotations

import json
from collections.abc import Sequence

import typer


def echo_facts(facts: dict[str, object], rows: Sequence[tuple[str, str]], as_json: bool) -> None:
    """`facts` as one JSON object, or `rows` (label, value) as a table."""
    if as_json:
        typer.echo(json.dumps(facts))
        return
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        typer.echo(f"{label:<{width}}  {value}")


def echo_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Columns aligned to their widest cell; numbers right-aligned."""
    cells = [[str(c) for c in header], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    numeric = [all(isinstance(row[i], int | float) for row in rows) if rows else False for i in range(len(header))]
    for r in cells:
        typer.echo("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, numeric)).rstrip())


def mib(num_bytes: object) -> str:
    return f"{int(num_bytes) / 2**20:.1f} MiB"  # type: ignore[arg-type]


def cut_off(finish_reason: str, max_new_tokens: int) -> str:
    """The mark under an answer the token budget cut off (docs/answers.md); empty for a finished one."""
    if finish_reason != "length":
        return ""
    return f"[cut off: the answer reached --max-new-tokens {max_new_tokens}; raise it for the rest]"


def empty_answer(text: str, finish_reason: str) -> str:
    """The mark for an answer the model ended before writing anything, so that a blank line is never
    all a question gets; empty for any other answer."""
    if text.strip():
        return ""
    return f"[no answer: the model ended it at once (finish_reason {finish_reason}); ask it differently or more briefly]"


SNIPPET_ROOM = 24  # the fewest characters of a snippet worth showing beside a source; fewer: none
SHOWN_WIDTH = 100  # the line width sources are fitted to when output is not a terminal


def source_lines(rows: Sequence[tuple[str, float | None, str]], width: int | None = None) -> list[str]:
    """(where, score, snippet) of each source (`rag.retrieval.Hit`: `file › section`) → one line each,
    with as much of the snippet as the line has room for (`ask`, `chat`'s /sources)."""
    import shutil

    width = width or shutil.get_terminal_size((SHOWN_WIDTH, 24)).columns
    out = []
    for where, score, snippet in rows:
        line = f"  {where}" + ("" if score is None else f" ({score:.2f})")
        room = width - len(line) - 4
        text = " ".join(snippet.split())
        if text and room >= SNIPPET_ROOM:
            line += ": " + (text if len(text) <= room else text[:room - 2].rsplit(" ", 1)[0] + " …")
        out.append(line)
    return out
