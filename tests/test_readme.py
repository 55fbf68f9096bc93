"""The README's Python snippets run as written, against a real corpus named my-corpus."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def snippet(heading: str) -> str:
    section = README.read_text().split(f"### {heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def my_corpus(tmp_path_factory, smollm):
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag import Corpus

    root = tmp_path_factory.mktemp("readme")
    docs = root / "docs"
    docs.mkdir()
    (docs / "paris.txt").write_text("The Eiffel Tower is a wrought-iron tower in Paris, France. It opened in 1889.")
    (docs / "rome.txt").write_text("The Colosseum is an ancient amphitheatre in the centre of Rome, Italy.")
    engine = PromptCache(*smollm, name="smollm2-135m-instruct")
    Corpus.build([docs], root / "my-corpus", engine=engine)
    return root


@pytest.mark.smollm
@pytest.mark.parametrize("heading", ["LangChain", "LlamaIndex"])
def test_snippet_runs_as_written(heading, my_corpus, monkeypatch, capsys):
    monkeypatch.chdir(my_corpus)
    exec(compile(snippet(heading), f"README {heading}", "exec"), {})
    answer = capsys.readouterr().out
    assert "Paris" in answer, answer
