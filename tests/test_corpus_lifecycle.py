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

    def load_engine(model: str, store, mode: str | None, dtype: str | None = None, adapter: str | None = None) -> PromptCache:
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
    copy = write(tmp_path / "copy", {"zorblat.txt": DOCS["zorblat.txt"]})  # same name and text: the same module
    c = tmp_path / "c"
    cli(capsys, "ingest", docs, "--corpus", c, "--chunk-tokens", "64")
    full = num_entries(capsys, c)
    assert full == 3  # the instructions, the zorblat module, the trains module

    # A document's identity is its name: the copy replaces d/zorblat.txt, and its module (the same key) stays stored.
    assert "replaced 1 document" in cli(capsys, "ingest", copy, "--corpus", c)
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


MORE = {  # unrelated to the questions below, so retrieval (k=1) finds the same module before and after
    "volcano.txt": "Volcanoes erupt when magma rises to the surface. Lava cools into basalt.",
    "rivers.md": "The Nile flows north into the Mediterranean Sea. The Amazon carries the most water.",
    "bread.txt": "Sourdough bread rises with wild yeast and lactic acid bacteria over many hours.",
}
QUESTIONS = ("What color is the zorblat?", "How often does the Blue Line leave?", "Where does the Blue Line stop?",
             "What does the zorblat taste like?")


def test_many_threads_ask_while_another_adds(own_store, tmp_path: Path) -> None:
    """Every answer equals the one the same call gives alone; nothing is lost; the corpus reopens intact.
    (The engine's own lock around model forwards comes with the engine's thread safety.)"""
    from concurrent.futures import ThreadPoolExecutor

    Corpus.build([write(tmp_path / "d", DOCS)], tmp_path / "c", chunk_tokens=64, progress=False).close()
    c = Corpus.open(tmp_path / "c")
    alone = {q: c.ask(q, k=1, max_new_tokens=8) for q in QUESTIONS}

    def ask(i: int) -> tuple[str, tuple[str, ...], str]:
        q = QUESTIONS[i % len(QUESTIONS)]
        if i % 2:
            s = c.ask_stream(q, k=1, max_new_tokens=8)
            text = "".join(s).strip()
            assert s.answer is not None and s.answer.answer == text
            return q, s.answer.module_ids, text
        a = c.ask(q, k=1, max_new_tokens=8)
        return q, a.module_ids, a.answer

    with ThreadPoolExecutor(5) as pool:
        adding = pool.submit(c.add, [write(tmp_path / "more", MORE)])
        answers = list(pool.map(ask, range(12)))
        report = adding.result()
    assert report.num_ingested == len(MORE)
    for q, module_ids, text in answers:
        assert (module_ids, text) == (alone[q].module_ids, alone[q].answer), q
    num_modules = c.info()["num_modules"]
    c.close()

    reopened = Corpus.open(tmp_path / "c")
    info = reopened.info()
    assert info["num_documents"] == len(DOCS) + len(MORE) and info["num_vectors"] == info["num_modules"] == num_modules
    assert reopened.search("Which bread uses wild yeast?", k=1)[0][0] in {m for m, _ in reopened.table.modules()}
    assert reopened.ask(QUESTIONS[0], k=1, max_new_tokens=8).answer == alone[QUESTIONS[0]].answer
    reopened.close()
