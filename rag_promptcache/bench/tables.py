"""One Markdown table from a header and rows: what the bench's report and its scenarios' own sections
(serve) write with; and the figure a scenario's plot is drawn on. Torch-free, so the report imports it
and a scenario imports it without either importing the other."""

from __future__ import annotations


def table(header: list[str], rows: list[list[object]]) -> str:
    # None: a value not measured (a ratio whose duration was below the clock's resolution)
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "n/a" if v is None else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def grid(rows: int, cols: int, width: float, row_height: float):
    """(figure, axes [rows][cols]) for a scenario's PNG plot, on matplotlib's Agg backend (no display);
    `save` writes and closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=(width, row_height * rows), squeeze=False)


def save(fig, path):
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
