"""The `rag-promptcache` command: one typer app, its error policy, and where subcommands plug in.

Exit codes: 0 ok, 1 user error (one line on stderr, no traceback), 2 internal error, or a question
too long for the model's context window (`TOO_LONG`, as click's usage errors: the input must change), 130 interrupted,
141 output closed early (`info | head -2`: quietly, with the code a shell gives a program SIGPIPE ends,
as `cat` or `git log` would; Python ignores SIGPIPE, so we turn its BrokenPipeError into that).
Heavy imports (torch, transformers, faiss) happen inside commands, so `--help` and `--version`
answer without importing torch (tests/test_cli_startup.py checks that).

Other packages add commands by exposing `register(app: typer.Typer) -> None` in a `cli` module
(`rag_promptcache.bench.cli` for `bench`); `_register_optional` picks them up when present. One whose
package imports torch on import (bench) is listed in LAZY: `--help` shows its line from there, and
its module is imported only when the command runs.
"""

from __future__ import annotations

import contextvars
import functools
import gc
import importlib
import json
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Annotated, TypeVar

import click
import typer
from typer.core import TyperCommand, TyperGroup

# command → (module with `register(app)`, the one line `--help` lists; test_cli_startup holds it true)
LAZY = {"bench": ("rag_promptcache.bench.cli", "Measure TTFT, quality, memory and throughput against full prefill; "
                  "write JSON, Markdown and plots.")}


class PlainUsage(TyperCommand):
    """A usage line in click's own style, `ask [OPTIONS] QUESTION`: typer writes a required argument
    as `{question}`, which reads like a template left unfilled."""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [re.sub(r"\{([^{}]+)\}|\[([a-z][\w-]*)\]", _upper, p) for p in super().collect_usage_pieces(ctx)]


def _upper(m: re.Match[str]) -> str:
    return m.group(1).upper() if m.group(1) is not None else f"[{m.group(2).upper()}]"


class App(typer.Typer):
    """The typer app whose commands print plain usage lines (`PlainUsage`); every command group and
    plugin registers on one."""

    def command(self, name: str | None = None, *, cls: type[TyperCommand] | None = None, **kwargs: object):  # type: ignore[override]
        return super().command(name, cls=cls or PlainUsage, **kwargs)  # type: ignore[arg-type]


class LazyGroup(TyperGroup):
    """The root command: a LAZY command is imported when it runs (or shows its own help), not when
    the root's help lists it."""

    listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *(name for name in LAZY if name not in self.commands)]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self.listing = False

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in LAZY or cmd_name in self.commands:
            return super().get_command(ctx, cmd_name)
        module, short_help = LAZY[cmd_name]
        if self.listing:
            return click.Command(cmd_name, help=short_help)
        plugin = App(rich_markup_mode=None, pretty_exceptions_enable=False, add_completion=False)
        if not _register(module, plugin):
            return None
        command = typer.main.get_group(plugin).get_command(ctx, cmd_name)
        if command is not None:
            self.add_command(command, cmd_name)
        return command


app = App(
    cls=LazyGroup,
    name="rag-promptcache",
    help="Answer questions over your documents fast: each chunk's KV cache is computed once and reused.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=None,  # help text is plain: a "[default: x]" we write is shown, not eaten as markup
)

F = TypeVar("F", bound=Callable[..., object])

# The one --dtype option of every command that loads a model (serve, eval: reuse it). Parse the value
# with `rag_promptcache.model.loading.parse_dtype` (None/"auto" → the device's default).
DtypeOpt = Annotated[str | None, typer.Option(
    "--dtype", help="auto, float32, bfloat16 or float16 [default: auto: a corpus's own dtype, else the device's "
                    "default (bfloat16 on a CPU with bf16 units and on CUDA, else float32)].")]
# What --dtype and --codec take, checked before torch is imported so that a wrong name answers at once (the
# full parsers, model.device.parse_dtype and store.check_codec, import torch); tests hold them equal to those.
SHOWN_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half", "float")
SHOWN_CODECS = ("native", "fp16", "bf16", "int8", "int4", "cachegen", "k8v4", "k6v6", "k7v5", "k5v5")


def check_name(option: str, value: str | None, valid: tuple[str, ...], listed: str = "valid") -> None:
    """`value` of `option` is one of `valid` (None: not given), else a ValueError that lists them after
    `listed` (the words the full parser uses: "valid codecs" for store.check_codec's)."""
    if value is not None and value.strip().lower().removeprefix("torch.") not in valid:
        raise ValueError(f"unknown {option} {value!r}; {listed}: {', '.join(valid)}")


# The one --adapter option of every command that loads a model (model/adapter.py).
AdapterOpt = Annotated[str, typer.Option(
    "--adapter", help="The tuned adapter merged into the model: default (the one shipped for the model, if one ships; "
                      "for an existing corpus, the one it was encoded with), none (the base model) or an adapter "
                      "directory.")]
# The one --redis-url option of every command that opens a corpus.
RedisOpt = Annotated[str | None, typer.Option(
    "--redis-url", help="A shared Redis tier for module KV, below memory and disk (default: $RAG_PROMPTCACHE_REDIS_URL).")]
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for `cat big | head -1`'s cat


def quiet_stdout() -> None:
    """The reader of stdout is gone (`| head`): point stdout at devnull so that the interpreter's
    final flush of what is still buffered does not raise a second BrokenPipeError at exit
    (https://docs.python.org/3/library/signal.html#note-on-sigpipe). Help text, printed by typer
    itself, is covered by typer's own handler (quietly, exit 1)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


ERROR_TYPES = {1: "invalid_request_error", 2: "internal_error", 130: "interrupted"}
JSON_ERRORS: contextvars.ContextVar[bool] = contextvars.ContextVar("json_errors", default=False)  # the command's --json


TOO_LONG = 2  # `ask`'s exit code for a question the model's context window cannot take


def fail(message: str, code: int = 1, error_code: str | None = None) -> typer.Exit:
    """One line on stderr; for a command run with --json, one JSON object on stdout instead,
    {"error": {"message", "type"}} (and "code", OpenAI's, where one is given: "context_length_exceeded"),
    so a reader of the JSON gets the failure in the same shape."""
    if JSON_ERRORS.get():
        kind = "invalid_request_error" if error_code else ERROR_TYPES.get(code, "error")
        typer.echo(json.dumps({"error": {"message": message, "type": kind, **({"code": error_code} if error_code else {})}}))
    else:
        typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def handle_errors(fn: F) -> F:
    """User errors → exit 1 with one line; anything else → exit 2 (traceback with RAG_PROMPTCACHE_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        token = JSON_ERRORS.set(bool(kwargs.get("as_json")))
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise
        except BrokenPipeError:  # the reader left (`| head`): not a failure of the command
            quiet_stdout()
            raise typer.Exit(SIGPIPE_EXIT) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None
        except USER_ERRORS as e:
            raise fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__) from None
        except Exception as e:  # noqa: BLE001 - the last line of defence: report, exit 2
            if os.environ.get("RAG_PROMPTCACHE_DEBUG"):
                traceback.print_exc()
            hint = "" if os.environ.get("RAG_PROMPTCACHE_DEBUG") else " (set RAG_PROMPTCACHE_DEBUG=1 for the traceback)"
            raise fail(f"internal error: {type(e).__name__}: {e}{hint}", code=2) from None
        finally:
            JSON_ERRORS.reset(token)

    return wrapper  # type: ignore[return-value]


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            installed = version("rag-promptcache")
        except PackageNotFoundError:  # run from a source tree that was never installed
            installed = "0+unknown"
        typer.echo(f"rag-promptcache {installed}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", callback=_version, is_eager=True),
) -> None:
    """Answer questions over your documents fast: each chunk's KV cache is computed once and reused."""


def _register(module: str, target: typer.Typer) -> bool:
    """`module.register(target)`; False when that package has no CLI (yet)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            return False
        raise
    mod.register(target)
    return True


def _register_optional(target: typer.Typer) -> None:
    for module in ("rag_promptcache.server.cli",):
        _register(module, target)


def registered() -> typer.Typer:
    """The app with every command registered: what `main` runs, and what the docs' CLI reference is
    generated from (docs/hooks.py)."""
    from rag_promptcache.cli import commands, demo, eval_cmd, ingest_cmd, kernels_cmd, store_cmds, tune_cmd  # noqa: F401 - registers the commands

    _register_optional(app)
    return app


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Usage errors exit 1, like every other user error."""
    registered()
    try:
        with warnings.catch_warnings():
            # one line per warning, like the errors, not Python's "file:line: Category" with source
            warnings.showwarning = lambda message, category, *a, **k: typer.echo(f"warning: {message}", err=True)
            code = app(args=argv, prog_name="rag-promptcache", standalone_mode=False)
        sys.stdout.flush()  # inside the try: a pipe closed early fails here, not at interpreter exit
    except typer.TyperException as e:  # usage errors (typer vendors click; this is its base class)
        e.show() if hasattr(e, "show") else typer.echo(f"error: {e}", err=True)
        sys.exit(1)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except BrokenPipeError:
        quiet_stdout()
        sys.exit(SIGPIPE_EXIT)
    finally:
        if argv is None:
            _quick_exit()
    sys.exit(code if isinstance(code, int) else 0)


def _quick_exit() -> None:
    """Before the interpreter's teardown of a command run from the shell: its last garbage collections
    walk every object the imports made (torch's and transformers' modules, a model's), a second of an
    `ask`'s wall time. Frozen objects are left out of them; each is still freed and finalized as the
    interpreter tears down, and atexit handlers and open files run and close as before. Not for a
    caller of `main(argv)` in its own process (a test), which goes on collecting."""
    gc.freeze()
