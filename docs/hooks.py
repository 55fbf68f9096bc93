"""MkDocs hook and generator: the CLI reference (docs/cli.md from `<!-- cli-reference -->` up to
`<!-- /cli-reference -->`) generated from the typer app with typer's own Markdown writer, so it cannot
drift from `rag-promptcache --help`. The page in the repository holds the generated text, so that it
reads on a forge too: `python docs/hooks.py` writes it (`make cli-docs`), tests/test_cli_docs.py fails
when it is stale, and the site build writes it into the page again. A failure fails the build; it is
never left blank. `make docs` runs the build with PYTHONPATH=. so that it reads this checkout's package."""

from __future__ import annotations

from pathlib import Path

PLACEHOLDER = "<!-- cli-reference -->"
END = "<!-- /cli-reference -->"
PAGE = Path(__file__).with_name("cli.md")


def cli_reference() -> str:
    import typer
    from typer.cli import get_docs_for_click

    from rag_promptcache.cli.app import registered

    command = typer.main.get_command(registered())
    docs = get_docs_for_click(obj=command, ctx=typer.Context(command), name="rag-promptcache")
    # each usage line is a synopsis, not a command to run (tests/test_docs.py reads the tag)
    docs = docs.replace("```console\n", "<!-- not run: a usage synopsis -->\n```console\n")
    return docs.replace("# `rag-promptcache`", "## `rag-promptcache`", 1)


def with_reference(markdown: str) -> str:
    """`markdown` with the text between the markers replaced by the reference generated now."""
    head, rest = markdown.split(PLACEHOLDER, 1)
    tail = rest.split(END, 1)[1] if END in rest else rest
    return f"{head}{PLACEHOLDER}\n{cli_reference().strip()}\n{END}{tail}"


def on_page_markdown(markdown: str, page, config, files) -> str:
    if PLACEHOLDER not in markdown:
        return markdown
    return with_reference(markdown)


if __name__ == "__main__":
    PAGE.write_text(with_reference(PAGE.read_text()))
