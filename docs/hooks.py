"""MkDocs hook: the CLI reference (docs/cli.md's `<!-- cli-reference -->`) generated from the typer app
with typer's own Markdown writer, so it cannot drift from `rag-promptcache --help`. A failure fails
the build; it is never left blank. `make docs` runs the build with PYTHONPATH=. so that it reads this
checkout's package."""

from __future__ import annotations

PLACEHOLDER = "<!-- cli-reference -->"


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
    return markdown.replace(PLACEHOLDER, cli_reference())
