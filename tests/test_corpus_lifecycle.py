"""A corpus over the real SmolLM2, the real embedder and its own on-disk store: what a user does
between questions. The engine a corpus hands out runs the corpus's prompts; removing or replacing
a document drops its modules' stored KV; many threads ask while another adds.

Shares the session's SmolLM2 (`smollm` in conftest.py); documents are a few sentences each."""

from __future__ import annotations

from pathlib import Path

import pytest

from rag_promptcache.rag import Corpus
from rag_promptcache.rag import corpus as corpus_mod

pytestmark = pytest.mark.smollm

DOCS = {
    "zorblat.txt": "The zorblat is a purple fruit that grows only on the island of Quenti. It tastes like lemon and honey.",
    "trains.md": "# Trains\n\nThe Blue Line train leaves the central station every 12 minutes. It stops at Harbor, Museum and Airport.",
}


@pytest.fixture(scope="module")
def embedder():
    from rag_promptcache.rag import Embedder

    return Embedder()


@pytest.fixture
def own_store(smollm, embedder, monkeypatch):
    """Corpora load the session's SmolLM2 over their own on-disk store, as the CLI does."""
    from rag_promptcache.engine import PromptCache

    def load_engine(model: str, store, mode: str | None) -> PromptCache:
        return PromptCache(*smollm, store=store, name=model, **({} if mode is None else {"mode": mode}))

    monkeypatch.setattr(corpus_mod, "_load_engine", load_engine)
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: embedder)


def write(root: Path, docs: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (root / name).write_text(text)
    return root


def test_a_freshly_opened_corpus_engine_runs_the_corpus_prompt(own_store, tmp_path: Path) -> None:
    Corpus.build([write(tmp_path / "d", DOCS)], tmp_path / "c", chunk_tokens=64, progress=False).close()
    c = Corpus.open(tmp_path / "c")
    ids = [m for m, _ in c.search("What color is the zorblat?", k=2)]
    prompt = c.prompt("What color is the zorblat?", ids)
    cached = c.engine.generate(prompt, max_new_tokens=6)
    full = c.engine.generate(prompt, max_new_tokens=6, use_cache=False)
    assert cached.text and cached.missed_modules == () and set(ids) <= set(cached.hit_modules)
    assert cached.prompt_tokens == full.prompt_tokens
    assert c.ask("What color is the zorblat?", k=2, max_new_tokens=6).answer == cached.text.strip()
    c.close()


def cli(capsys, *argv: object) -> str:
    from rag_promptcache.cli import main

    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    assert exc.value.code == 0, out.err
    return out.out


def num_entries(capsys, corpus: Path) -> int:
    import json

    return json.loads(cli(capsys, "store", "info", "--corpus", corpus, "--json"))["num_entries"]


def test_remove_and_reingest_drop_the_stored_kv(own_store, tmp_path: Path, capsys) -> None:
    docs = write(tmp_path / "d", DOCS)
    copy = write(tmp_path / "copy", {"zorblat.txt": DOCS["zorblat.txt"]})  # same label and text: one shared module
    c = tmp_path / "c"
    cli(capsys, "ingest", docs, copy, "--corpus", c, "--chunk-tokens", "64")
    full = num_entries(capsys, c)
    assert full == 3  # the instructions, the zorblat module (stored once), the trains module

    cli(capsys, "remove", "--corpus", c, copy / "zorblat.txt")  # still used by d/zorblat.txt: its KV stays
    assert num_entries(capsys, c) == full
    cli(capsys, "remove", "--corpus", c, "trains.md")  # the name `ask` prints in its sources
    assert num_entries(capsys, c) == full - 1

    (docs / "zorblat.txt").write_text("The zorblat is a green fruit now. It tastes of pepper.")
    (docs / "trains.md").unlink()
    cli(capsys, "ingest", docs, "--corpus", c)
    assert num_entries(capsys, c) == full - 1  # the edited document's old module went, its new one came
    opened = Corpus.open(c)
    assert "green" in opened.ask("What color is the zorblat?", k=1, max_new_tokens=8).answer.lower()
    opened.close()
