"""Rough edges a fourth trial found (issue 43, section 3), each held shut: the demo marks a cut-off
answer, usage lines carry no brace placeholders, the packaging metadata gives setuptools nothing to
warn about, the docs point to what is there, and the README says where the tuned adapter's full
prefill was measured. CLI tests run over the fake engine of test_rag_corpus."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from test_cli import cut_off, fakes, run  # noqa: F401 - fakes is a fixture

ROOT = Path(__file__).resolve().parent.parent


def test_the_demo_marks_an_answer_the_budget_cut_off(tmp_path: Path, fakes, capsys) -> None:  # noqa: F811
    fakes.stream = cut_off("The yield statement")
    code, out, err = run(capsys, "demo", "--corpus", tmp_path / "demo", "--max-new-tokens", "2")
    assert code == 0, err
    assert out.count("[cut off: the answer reached --max-new-tokens 2; raise it for the rest]") == 3


def test_the_demo_leaves_a_finished_answer_unmarked(tmp_path: Path, fakes, capsys) -> None:  # noqa: F811
    code, out, err = run(capsys, "demo", "--corpus", tmp_path / "demo")
    assert code == 0, err
    assert "cut off" not in out


COMMANDS = (("ask",), ("eval",), ("ingest",), ("remove",), ("chat",), ("tune",), ("store", "info"), ("serve",))


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_usage_lines_name_arguments_without_braces(command: tuple[str, ...], capsys) -> None:
    code, out, _ = run(capsys, *command, "--help")
    usage = out.splitlines()[0]
    assert code == 0 and usage.startswith(f"Usage: rag-promptcache {' '.join(command)} [OPTIONS]")
    assert "{" not in usage and "}" not in usage, usage


def test_a_bad_option_value_shows_the_argument_in_capitals(tmp_path: Path, capsys) -> None:
    code, _, err = run(capsys, "ask", "-k", "many", "Where?", "-c", tmp_path)
    assert code == 1 and "Usage: rag-promptcache ask [OPTIONS] QUESTION" in err, err
    code, _, err = run(capsys, "ingest", "--chunk-tokens", "x", tmp_path, "-c", tmp_path / "c")
    assert code == 1 and "Usage: rag-promptcache ingest [OPTIONS] PATHS..." in err, err


@pytest.mark.parametrize("pyproject", ["pyproject.toml", "integrations/langchain/pyproject.toml",
                                       "integrations/llamaindex/pyproject.toml"])
def test_the_license_is_an_spdx_expression(pyproject: str) -> None:
    # a TOML table makes setuptools (>= 77) print "project.license as a TOML table is deprecated" at
    # every build; the SPDX string needs a setuptools that reads it
    meta = tomllib.loads((ROOT / pyproject).read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", ()))
    setuptools = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools and tuple(map(int, re.search(r">=\s*([\d.]+)", setuptools[0]).group(1).split("."))) >= (77,)


def test_the_committed_cli_page_is_the_reference_the_cli_generates_now() -> None:
    """docs/cli.md holds the generated reference (read on a forge, not only in the site): regenerated here,
    in a process of its own as `make cli-docs` runs it (the commands are listed in the order they register,
    which the imports of a test session would change), it must come out the same."""
    import os
    import subprocess
    import sys

    source = (ROOT / "docs" / "cli.md").read_text()
    assert "## `rag-promptcache`" in source and "## `rag-promptcache ask`" in source and "QUESTION" in source
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('h', 'docs/hooks.py'); "
            "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h); "
            "sys.stdout.write(h.on_page_markdown(h.PAGE.read_text(), None, None, None))")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    built = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert built.stdout == source, "docs/cli.md is stale: run `make cli-docs`"


def test_the_server_page_describes_response_format_where_it_says_it_does() -> None:
    text = (ROOT / "docs" / "server.md").read_text()
    described = text.index("`response_format`")
    assert described < text.index("Refused, not ignored") < text.index("is supported: the chat completion fields above")
    assert "json_object" in text[described: described + 300] and "concepts.md#structured-output" in text


def test_the_readme_says_where_the_tuned_full_prefill_was_measured() -> None:
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "answers more questions with full prefill than the base model does" not in text
    assert "609 of the fidelity benchmark's 720 questions against the base model's 544" in text
    assert "three splits, two draws" in text and "5 against 6 of 15" in text


def test_a_chats_first_turn_is_asks_prompt_and_a_follow_up_carries_its_own_modules(tmp_path: Path, fakes, capsys,  # noqa: F811
                                                                                     monkeypatch) -> None:
    from test_rag_corpus import write_docs

    from rag_promptcache.cli import commands
    from rag_promptcache.rag import Corpus

    corpus = tmp_path / "c"
    assert run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", corpus, "--chunk-tokens", "32")[0] == 0
    first, follow_up = "Which way does the Nile flow?", "What cools into rock?"
    assert run(capsys, "ask", first, "--corpus", corpus, "-k", "2")[0] == 0
    asked, asked_with = fakes.prompts[-1], fakes.sampling
    lines = iter([first, follow_up])

    def typed(_: str) -> str:
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(commands, "_prompt", typed)
    code, out, err = run(capsys, "chat", "--corpus", corpus, "-k", "2")
    assert code == 0, err
    turn1, turn2 = fakes.prompts[-2:]
    assert turn1 == asked and fakes.sampling.keys() == asked_with.keys()  # the same prompt and options as ask
    c = Corpus.open(corpus)
    try:
        own = [h.module_id for h in c.retrieve(follow_up, 2)]
        earlier = [h.module_id for h in c.retrieve(first, 2)]
    finally:
        c.close()
    assert set(own) != set(earlier)  # the follow-up retrieves other modules ...
    imports = re.findall(r"<(m[0-9a-f]{16})/>", turn2)
    assert sorted(imports) == sorted(own)  # ... and imports those, not the first turn's
    answer1 = re.search(r"bot> (.*?)\n", out).group(1).strip()
    # modules first, then the earlier turn, and the question last
    assert turn2.rindex(f"<{imports[-1]}/>") < turn2.index(first) < turn2.index(answer1) < turn2.rindex(follow_up)
    assert turn2.endswith(f"<user>{follow_up}</user></prompt>")
