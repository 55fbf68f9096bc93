"""`rag-promptcache kernels build|check`: the native CPU kernels' explicit build step (model/native.py).

`pip install` builds them (setup.py); this rebuilds them after their sources change, or where the
install could not. Not here: the build itself, which native.build owns.
"""

from __future__ import annotations

from typing import Annotated

import typer

from rag_promptcache.cli.app import App, app, handle_errors

kernels_app = App(help="Build or check the native CPU kernels (AVX512-BF16).", no_args_is_help=True)
app.add_typer(kernels_app, name="kernels")


@kernels_app.command("build")
@handle_errors
def kernels_build(
    directory: Annotated[str | None, typer.Argument(help="Build here [default: the package, else the cache home].")] = None,
) -> None:
    """Compile the kernels with the system C compiler; exit 1 where they cannot be built."""
    from rag_promptcache.model import native

    raise typer.Exit(native.main(["build", *([directory] if directory else [])]))


@kernels_app.command("check")
@handle_errors
def kernels_check() -> None:
    """Say which library loads here, or why none does; exit 1 when the torch code would run."""
    from rag_promptcache.model import native

    raise typer.Exit(native.main(["check"]))
