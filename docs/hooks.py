"""MkDocs hook: the CLI reference (docs/cli.md's `<!-- cli-reference -->` up to `<!-- /cli-reference -->`,
which in the source says where the reference lives) generated from the typer app
with typer's own Markdown writer, so it cannot drift from `rag-promptcache --help`. A failure fails
the build; it is never left blank. `make docs` runs the build with PYTHONPATH=. so that it reads this
checkout's package."""

from __future__ import annotations

PLACEHOLDER = "<!-- cli-reference -->"
END = "<!-- /cli-reference -->"  # the text up to it says, to a reader of the source, where the reference lives


def cli_reference() -> str:
    import typer
    from typer.cli import get_docs_for_click

    from rag_promptcache.cli.app import registered

    command = typer.main.get_command(registered())
    docs = get_docs_for_click(obj=command, ctx=typer.Context(command), name="rag-promptcache")
    return docs.replace("# `rag-promptcache`", "## `rag-promptcache`", 1)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if PLACEHOLDER not in markdown:
        return markdown
    head, rest = markdown.split(PLACEHOLDER, 1)
    tail = rest.split(END, 1)[1] if END in rest else rest
    return head + cli_reference() + tail
