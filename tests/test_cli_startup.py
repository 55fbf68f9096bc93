"""Start-up and noise (issue 25, items 10 and 11's `info` half): `--help` and `--version` answer
without importing torch (checked on the modules a real process imported, not by the clock); model
loading shows no "Loading weights" bar; the CLI silences library notices a user cannot act on;
`ingest --ray` quiets Ray's; `info` names the corpus schema."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from test_cli import built, fakes, run  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "faiss", "sentence_transformers", "numpy")
PROBE = ("import sys\nfrom rag_promptcache.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         "print('\\nIMPORTED', sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)")


def imported(*argv: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    return json.loads(done.stderr.split("IMPORTED ")[-1].strip().replace("'", '"'))


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["ask", "--help"], ["ingest", "--help"], []])
def test_help_and_version_do_not_import_torch(argv: list[str]) -> None:
    assert imported(*argv) == []


TORCH_STACK = ("torch", "transformers", "faiss", "sentence_transformers")
FAILURE = ("import sys\nfrom rag_promptcache.cli import main\ncode = 0\ntry:\n    main(sys.argv[1:])\n"
           "except SystemExit as e:\n    code = e.code\n"
           "print('\\nEXIT', code, sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)")


@pytest.mark.parametrize("argv, message", [
    (["ask", "--corpus", "{missing}", "a question"], "does not exist; create one with"),
    (["chat", "--corpus", "{missing}"], "does not exist"),
    (["info", "--corpus", "{missing}"], "does not exist"),
    (["remove", "doc.txt", "--corpus", "{missing}"], "does not exist"),
    (["info", "--corpus", "{plain}"], "is not a corpus (no manifest.json)"),
    (["ingest", "{missing}", "--corpus", "{missing}"], "no such file or directory"),
    (["ingest", "{plain}", "--corpus", "{missing}", "--dtype", "float8"], "unknown dtype 'float8'; valid: auto, float32"),
    (["ingest", "{plain}", "--corpus", "{missing}", "--codec", "gzip"], "unknown codec 'gzip'; valid codecs: native, fp16"),
    (["ask", "--corpus", "{plain}", "q", "--dtype", "double"], "unknown dtype 'double'"),
    (["eval", "{missing}", "--corpus", "{plain}"], "no such file"),
    (["eval", "{questions}", "--corpus", "{missing}"], "does not exist"),
    (["eval", "{questions}", "--corpus", "{missing}", "--codec", "int8"], "does not exist"),
    (["tune", "--corpus", "{missing}"], "does not exist"),
    (["serve", "--corpus", "{missing}"], "does not exist"),
    (["ingest", "--no-such-option"], "No such option"),
    (["ask", "--corpus", "{plain}"], "Missing argument"),
])
def test_usage_and_file_errors_come_back_before_torch_is_imported(argv: list[str], message: str, tmp_path: Path) -> None:
    """A wrong path, name or option is one line from the CLI without torch and transformers loaded (they
    take seconds to import): checked on the modules the process imported, not by the clock."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "q.jsonl").write_text('{"question": "Why?"}\n')
    fill = {"missing": str(tmp_path / "missing"), "plain": str(tmp_path / "plain"), "questions": str(tmp_path / "q.jsonl")}
    args = [a.format(**fill) for a in argv]
    done = subprocess.run([sys.executable, "-c", FAILURE.format(heavy=HEAVY), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    err, _, tail = done.stderr.rpartition("\nEXIT ")
    code, _, modules = tail.strip().partition(" ")
    assert code in ("1", "2") and message in err + done.stdout, (done.stdout, done.stderr)
    assert [m for m in json.loads(modules.replace("'", '"')) if m in TORCH_STACK] == []


def test_importing_the_cli_and_registering_every_command_imports_no_torch() -> None:
    code = ("import sys, rag_promptcache.cli\nfrom rag_promptcache.cli.app import registered\nregistered()\n"
            f"print(sorted(m for m in {TORCH_STACK!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_ingest_help_lists_what_the_loaders_take(capsys) -> None:
    from rag_promptcache.rag.loaders import SUFFIXES

    code, out, _ = run(capsys, "ingest", "--help")
    assert code == 0
    listed = " ".join(out.split())
    assert all(s in listed for s in SUFFIXES) and {".markdown", ".rst", ".text", ".htm"} <= set(SUFFIXES)


def test_the_lazy_bench_line_is_the_bench_docstring(capsys) -> None:
    import typer

    from rag_promptcache.bench.cli import register
    from rag_promptcache.cli.app import LAZY

    plugin = typer.Typer()
    register(plugin)
    real = typer.main.get_command(plugin)
    assert " ".join(real.help.split()) == LAZY["bench"][1]
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "bench" in out and "serve" in out


def test_help_shows_the_shared_repetition_default() -> None:
    from rag_promptcache.cli.commands import SHOWN_NO_REPEAT_NGRAM
    from rag_promptcache.rag import corpus
    from rag_promptcache.rag.repetition import DEFAULT_NO_REPEAT_NGRAM

    assert SHOWN_NO_REPEAT_NGRAM == DEFAULT_NO_REPEAT_NGRAM == corpus.DEFAULT_NO_REPEAT_NGRAM


def test_loading_a_model_shows_no_progress_bar_and_keeps_the_callers_setting(tmp_path: Path, capfd) -> None:
    from tiny import build
    from transformers.utils import logging as hf_logging

    from rag_promptcache.model.loading import load_model

    build("llama").save_pretrained(tmp_path / "m")
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    with pytest.raises(ValueError):  # no tokenizer files: the weights load first, then it fails
        load_model(str(tmp_path / "m"), device="cpu")
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # an application's own bars stay on


def test_the_cli_prints_a_warning_as_one_line(capsys, monkeypatch) -> None:
    # transformers' deprecation of `past_key_values=` is not filtered here: the engine passes the
    # keyword transformers asks for (engine.runner.cache_arg; tests/test_rough_edges.py)
    from rag_promptcache.cli.app import app

    monkeypatch.setattr(app, "registered_commands", list(app.registered_commands))

    @app.command("noisy")
    def noisy() -> None:
        warnings.warn("something the user can act on", UserWarning, stacklevel=1)

    code, _, err = run(capsys, "noisy")
    assert code == 0 and err == "warning: something the user can act on\n"


def test_ingest_ray_quiets_ray_for_its_own_local_cluster(monkeypatch) -> None:
    from rag_promptcache.cli.commands import quiet_ray

    # a copy of the environment for this test: what quiet_ray sets must not reach later tests (an
    # in-process ray.init with RAY_AUTH_MODE=token left over failed to start Ray in test_ray_ingest)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_COLOR_PREFIX")})
    quiet_ray(None)
    assert os.environ["RAY_AUTH_MODE"] == "token"  # Ray's default, said explicitly: no warning
    assert os.environ["RAY_COLOR_PREFIX"] == "0"  # pytest's stderr is not a terminal
    del os.environ["RAY_AUTH_MODE"]
    os.environ["RAY_COLOR_PREFIX"] = "1"
    quiet_ray("auto")  # someone else's cluster keeps its auth settings; the user's variables win
    assert "RAY_AUTH_MODE" not in os.environ and os.environ["RAY_COLOR_PREFIX"] == "1"


def test_info_names_the_schema(built: Path, capsys) -> None:
    facts = json.loads(run(capsys, "info", "--corpus", built, "--json")[1])
    assert facts["schema"].startswith("rag_")
    code, out, _ = run(capsys, "info", "--corpus", built)
    assert code == 0 and f'schema        {facts["schema"]} (PML prompts import its modules: <prompt schema="{facts["schema"]}">)' in out
