"""End to end with the real SmolLM2 and the real embedder: ingest a tiny corpus, ask, fall back.

Shares the session's SmolLM2 (`smollm` in conftest.py); the corpus is two short documents so that
ingest costs a few forward passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_promptcache.rag import Corpus
from rag_promptcache.rag import corpus as corpus_mod

pytestmark = pytest.mark.smollm

DOCS = {
    "zorblat.txt": "The zorblat is a purple fruit that grows only on the island of Quenti. "
    "It tastes like lemon and honey.\n\nFarmers harvest zorblats in the month of Ember.",
    "trains.md": "# Trains\n\nThe Blue Line train leaves the central station every 12 minutes. "
    "It stops at Harbor, Museum and Airport.",
}


@pytest.fixture(scope="module")
def engine(smollm):
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.store import MemoryStore

    model, tokenizer = smollm
    return PromptCache(model, tokenizer, store=MemoryStore(), name="smollm2-135m-instruct")


@pytest.fixture(scope="module")
def embedder():
    from rag_promptcache.rag import Embedder

    return Embedder()


@pytest.fixture(scope="module")
def corpus(engine, embedder, tmp_path_factory) -> Corpus:
    root = tmp_path_factory.mktemp("docs")
    for name, text in DOCS.items():
        (root / name).write_text(text)
    return Corpus.build([root], tmp_path_factory.mktemp("c") / "corpus", engine=engine, embedder=embedder,
                        chunk_tokens=64, overlap=8, progress=False)


def test_ingest_with_the_real_tokenizer(corpus: Corpus, engine) -> None:
    info = corpus.info()
    assert info["num_documents"] == 2 and info["num_modules"] >= 2
    for _, text in corpus.table.modules():
        assert len(engine.tokenizer.encode(text, add_special_tokens=False)) <= corpus.manifest.max_tokens


def test_ask_uses_cached_modules_and_answers(corpus: Corpus) -> None:
    hits = corpus.search("What color is the zorblat fruit?", k=1)
    assert corpus.source(hits[0][0]).endswith("zorblat.txt")
    answer = corpus.ask("What color is the zorblat fruit?", k=2, max_new_tokens=12)
    assert answer.sources[0] == "zorblat.txt" and answer.answer
    assert answer.missed_modules == () and set(answer.hit_modules) >= set(answer.module_ids)
    assert answer.cached_tokens > answer.computed_tokens > 0
    assert "purple" in answer.answer.lower()
    streamed = corpus.ask_stream("What color is the zorblat fruit?", k=2, max_new_tokens=12)
    assert "".join(streamed).strip() == answer.answer and streamed.answer.answer == answer.answer


def test_missing_module_kv_is_recomputed_with_the_same_answer(corpus: Corpus, engine) -> None:
    before = corpus.ask("How often does the Blue Line leave?", k=1, max_new_tokens=10)
    engine.store.evict_to(0)  # drop every module's KV
    after = corpus.ask("How often does the Blue Line leave?", k=1, max_new_tokens=10)
    assert after.missed_modules and after.answer == before.answer


def test_cli_ingest_and_ask_json(smollm, embedder, tmp_path: Path, capsys, monkeypatch) -> None:
    """Two commands, two engines over the corpus's own on-disk store: the ask hits what ingest stored."""
    from rag_promptcache.cli import main
    from rag_promptcache.engine import PromptCache

    def load_engine(model: str, store, mode: str | None, dtype: str | None = None, adapter: str | None = None) -> PromptCache:  # the session's model
        return PromptCache(*smollm, store=store, name=model, **({} if mode is None else {"mode": mode}))

    monkeypatch.setattr(corpus_mod, "_load_engine", load_engine)
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: embedder)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "trains.md").write_text(DOCS["trains.md"])
    for argv in (["ingest", str(tmp_path / "d"), "--corpus", str(tmp_path / "c")],
                 ["ask", "--corpus", str(tmp_path / "c"), "Where does the Blue Line stop?", "--json", "--max-new-tokens", "8"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0, capsys.readouterr().err
    answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert answer["sources"] == ["trains.md"] and answer["answer"] and answer["missed_modules"] == []
