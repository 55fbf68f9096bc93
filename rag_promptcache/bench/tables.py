"""One Markdown table from a header and rows: what the bench's report and its scenarios' own sections
(serve) write with. Torch-free, so the report imports it and a scenario imports it without either
importing the other."""

from __future__ import annotations


def table(header: list[str], rows: list[list[object]]) -> str:
    # None: a value not measured (a ratio whose duration was below the clock's resolution)
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "n/a" if v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
