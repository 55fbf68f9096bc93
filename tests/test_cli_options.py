"""CLI options and output over the fake engine: sampling flags reach the engine, the stream/json
pair streams JSON lines, help shows defaults, the window error counts what it names, --version."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_cli import assert_user_error, built, fakes, run  # noqa: F401 - fixtures

from rag_promptcache.rag.corpus import DEFAULT_NO_REPEAT_NGRAM


def test_sampling_flags_reach_the_engine(built: Path, fakes, capsys) -> None:
    code, _, err = run(capsys, "ask", "--corpus", built, "cats?", "-k", "1")
    assert code == 0, err
    assert fakes.sampling["no_repeat_ngram"] == DEFAULT_NO_REPEAT_NGRAM > 0 and "recovery" not in fakes.sampling
    code, _, err = run(capsys, "ask", "--corpus", built, "cats?", "-k", "1", "--temperature", "0.7", "--repetition-penalty", "1.2",
                       "--no-repeat-ngram", "0", "--recovery", "none", "--stop", "END", "--stop", "\n\n")
    assert code == 0, err
    assert {k: fakes.sampling[k] for k in ("temperature", "repetition_penalty", "no_repeat_ngram", "recovery", "stop")} == {
        "temperature": 0.7, "repetition_penalty": 1.2, "no_repeat_ngram": 0, "recovery": "none", "stop": ("END", "\n\n")}


def test_stream_json_is_json_lines(built: Path, capsys) -> None:
    code, out, err = run(capsys, "ask", "--corpus", built, "volcano lava?", "-k", "1", "--stream", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["delta"] for line in lines[:-1]] == ["echo: ", lines[-1]["module_ids"][0]]
    assert lines[-1]["answer"] == "echo: " + lines[-1]["module_ids"][0] and lines[-1]["sources"] == ["sub/volcano.txt"]


def test_the_window_error_counts_what_it_names(built: Path, capsys) -> None:
    err = run(capsys, "ask", "--corpus", built, "cats?", "-k", "2", "--max-new-tokens", "4090")[2]
    # the CLI names its own flag where the library's message names the keyword
    assert_user_error((1, "", err), "plus --max-new-tokens 4090", "for the best retrieved chunk", "question",
                      "4096-token window")
    assert "history" not in err
    needed = int(err.split("the prompt needs ")[1].split(" tokens")[0])
    assert f"lower --max-new-tokens to at most {4096 - needed}" in err


def test_help_shows_defaults_and_version(capsys) -> None:
    code, out, _ = run(capsys, "ingest", "--help")
    out = " ".join(out.split())  # help is wrapped to the terminal
    assert code == 0 and "[default: smollm2-135m-instruct]" in out and "[default: 256]" in out
    assert not re.search(r" \.(\s|$)", out)  # a stray " ." is what an eaten "[default: ...]" left
    code, out, _ = run(capsys, "ask", "--help")
    out = " ".join(out.split())
    assert code == 0 and f"[default: {DEFAULT_NO_REPEAT_NGRAM}]" in out and "--repetition-penalty" in out and "--recovery" in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("rag-promptcache ")


def test_info_lists_documents_in_the_table_style(built: Path, capsys) -> None:
    code, out, _ = run(capsys, "info", "--corpus", built)
    assert code == 0 and "document" in out and "sub/volcano.txt" in out and "cats.txt" in out
    facts = json.loads(run(capsys, "info", "--corpus", built, "--json")[1])
    assert {d["name"] for d in facts["documents"]} == {"cats.txt", "rivers.md", "sub/volcano.txt"}
    code, out, _ = run(capsys, "remove", "sub/volcano.txt", "--corpus", built)  # the name, as sources print it
    assert code == 0 and "removed sub/volcano.txt" in out
    assert_user_error(run(capsys, "remove", "nope.txt", "--corpus", built), "no document 'nope.txt'", "--documents")


def test_a_bad_fidelity_split_is_a_user_error_before_the_model_loads(capsys) -> None:
    assert_user_error(run(capsys, "bench", "--scenarios", "fidelity", "--fidelity-split", "nope"),
                      "unknown --fidelity-split 'nope'; valid: bench, heldout, manuals, both, all")


def test_a_scenario_that_became_a_harness_is_refused_by_name_with_its_command(capsys) -> None:
    assert_user_error(run(capsys, "bench", "--scenarios", "ttft,soak"),
                      "unknown --scenarios soak; valid: ttft, quality", "python -m benchmarks.soak (benchmarks/README.md)")
    assert_user_error(run(capsys, "bench", "--scenarios", "nope"), "unknown --scenarios nope; valid: ttft")


def test_serve_admission_reaches_the_bench_config_and_a_bad_one_is_a_user_error(capsys, monkeypatch) -> None:
    import rag_promptcache.bench as bench

    seen = []
    monkeypatch.setattr(bench, "run", lambda **kw: seen.append(kw["config"]))
    code, _, err = run(capsys, "bench", "--scenarios", "serve", "--serve-admission", "one")
    assert code == 0 and seen[-1].serve_admission == "one", err
    code, _, err = run(capsys, "bench", "--scenarios", "serve")
    assert code == 0 and seen[-1].serve_admission == "all", err
    assert_user_error(run(capsys, "bench", "--scenarios", "serve", "--serve-admission", "each"),
                      "unknown --serve-admission 'each'; valid: all, one")
