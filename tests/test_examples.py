"""Smoke test: each example runs end to end on the embedded defaults with a tiny budget (one topic of
the Python reference, one question, a few tokens), sharing one small corpus."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BUDGET = ["--topics", "1", "--max-tokens", "8"]
EXAMPLES = [
    ("langchain_rag.py", ["--questions", "1"], "cached"),
    ("llamaindex_query_engine.py", ["--questions", "1"], "sources:"),
    ("chatbot.py", ["--ask", "What does a for loop do?", "And break?"], "prompt tokens cached"),
]

pytest.importorskip("langchain_rag_promptcache", reason="pip install -e integrations/langchain")
pytest.importorskip("llama_index.llms.rag_promptcache", reason="pip install -e integrations/llamaindex")


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("examples") / "corpus"


@pytest.mark.smollm
@pytest.mark.parametrize(("script", "extra", "expected"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_example_runs(script: str, extra: list[str], expected: str, corpus_dir: Path) -> None:
    cmd = [sys.executable, str(ROOT / "examples" / script), "--corpus", str(corpus_dir), *BUDGET, *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Q:" in done.stdout or "bot>" in done.stdout
    assert expected in done.stdout, done.stdout[-2000:]


@pytest.mark.parametrize("script", [e[0] for e in EXAMPLES])
def test_example_help_shows_the_whole_first_paragraph_and_defaults(script: str, capsys, monkeypatch) -> None:
    import runpy

    module = runpy.run_path(str(ROOT / "examples" / script), run_name="example")
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit):
        module["main"]()
    out = " ".join(capsys.readouterr().out.split())
    paragraph = " ".join(module["__doc__"].split("\n\n")[0].split())
    assert paragraph in out and paragraph.endswith(".") and "(default:" in out
