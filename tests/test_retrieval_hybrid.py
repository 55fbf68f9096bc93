"""Hybrid retrieval (BM25 beside FAISS, fused by rank) and its index files, with the fake engine and
embedder of test_rag_corpus.py: what each ranking finds, the fusion, a question with no lexical match,
and a lexical or vector index that is missing, damaged, behind the table or from before hybrid retrieval."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from rag_promptcache.rag import retrieval
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.index import faiss_id
from rag_promptcache.rag.layout import CorpusWarning
from rag_promptcache.rag.lexical import LexicalIndex, tokens
from tests.test_rag_corpus import FakeEmbedder, FakeEngine, build, write_docs

DOCS = {
    "pragmas.md": "# Pragmas\n\nThe journal_mode pragma chooses how the rollback journal is kept.\n\n"
                  "## Sync\n\nThe synchronous pragma trades durability for speed on every commit.\n\n",
    "stash.md": "# Stashing\n\nUse --keep-index to leave the staged changes in place while stashing the rest.\n\n",
    "weather.txt": "Clouds form when moist air rises and cools. Rain falls when droplets grow heavy.\n\n" * 3,
}


@pytest.fixture
def corpus(tmp_path: Path) -> Corpus:
    c = build(write_docs(tmp_path / "docs", DOCS), tmp_path / "c")
    yield c
    c.close()


def test_tokens_keep_compounds_and_their_parts_and_drop_question_words() -> None:
    got = tokens("Which PRAGMA sets journal_mode? Use --keep-index with v3.7.0")
    assert {"journal_mode", "journal", "mode", "keep-index", "keep", "index", "v3.7.0", "pragma"} <= set(got)
    assert "which" not in got and "with" not in got
    assert tokens("数据库") == ["数据", "据库"]  # no spaces in CJK text: character bigrams


def test_fuse_is_weighted_reciprocal_rank() -> None:
    assert retrieval.fuse([[1, 2, 3], [3, 2]]) == [3, 2, 1]  # 3: 1/63 + 1/61 beats 2: 1/62 + 1/62, by a hair
    assert retrieval.fuse([[1, 2], [2, 1]], (1.0, 2.0)) == [2, 1]
    assert retrieval.fuse([[5, 6], []]) == [5, 6]  # one ranking empty: the other's order


def test_every_mode_ranks_and_scores_are_cosine(corpus: Corpus) -> None:
    question = "which option keeps the staged changes when stashing"
    vector = corpus.embedder.embed([question])[0]
    for mode in retrieval.MODES:
        hits = corpus.search(question, k=2, mode=mode)
        assert corpus.source(hits[0][0]).endswith("stash.md"), mode
        ids = [faiss_id(m) for m, _ in hits]
        stored = corpus.table.vectors_for(ids)
        assert [s for _, s in hits] == pytest.approx([float(stored[i] @ vector) for i in ids], abs=1e-5)
    with pytest.raises(ValueError, match="valid: hybrid, dense, lexical"):
        corpus.search(question, k=2, mode="sparse")


def test_lexical_finds_a_name_the_embedding_blurs(corpus: Corpus) -> None:
    # The fake embedder hashes words into 64 buckets; BM25 matches the option name itself.
    hits = corpus.search("journal_mode", k=1)
    assert "journal_mode" in corpus.text(hits[0][0])
    assert corpus.search("journal_mode", k=1, mode="lexical")[0][0] == hits[0][0]


def test_a_question_with_no_lexical_match_is_ranked_by_the_dense_half(corpus: Corpus) -> None:
    question = "zzqx vvwk"  # no word of it is in the corpus
    assert corpus.lexical.search(question, 5) == []
    assert corpus.search(question, k=3) == corpus.search(question, k=retrieval.FUSION_DEPTH, mode="dense")[:3]
    assert corpus.search(question, k=3, mode="lexical") == []
    assert corpus.search("the of and", k=2)  # stop words only: dense alone, no error


def test_headings_give_each_chunk_its_context_and_retrieval_reads_it(corpus: Corpus) -> None:
    contexts = dict(corpus.table.db.execute("SELECT text, context FROM modules").fetchall())
    sync = next(c for t, c in contexts.items() if "synchronous" in t)
    assert sync == "Pragmas › Sync"  # the title (first `# ` heading) and the section
    module = next(t for t in contexts if "synchronous" in t)
    assert module.startswith("[Pragmas › Sync]\n")  # the model reads it too (chunker.MODULE_HEADER)
    ids, texts, _ = corpus.table.search_texts()
    assert any(t.startswith("Pragmas › Sync\n") for t in texts)
    # the heading word alone finds its section, through the context both rankings read
    assert "synchronous" in corpus.text(corpus.search("Sync", k=1, mode="lexical")[0][0])


def test_removed_and_added_documents_reach_the_lexical_index(corpus: Corpus, tmp_path: Path) -> None:
    corpus.remove("stash.md")
    assert all("keep-index" not in corpus.text(m) for m, _ in corpus.search("keep-index stashing", k=3, mode="lexical"))
    (tmp_path / "docs" / "bees.txt").write_text("Bees dance to tell the hive where the clover grows.\n\n")
    corpus.add([tmp_path / "docs"], progress=False)
    assert "clover" in corpus.text(corpus.search("clover", k=1, mode="lexical")[0][0])
    _, saved = LexicalIndex.load(corpus.path / "lexical")
    assert saved == corpus.table.generation  # saved after the ingest, not rebuilt at the next open


def test_hot_reload_sees_another_process_ingest(corpus: Corpus, tmp_path: Path) -> None:
    other = Corpus.open(corpus.path, FakeEngine(), embedder=FakeEmbedder())
    (tmp_path / "docs" / "owls.txt").write_text("Owls hunt voles at night with silent feathers.\n\n")
    other.add([tmp_path / "docs"], progress=False)
    other.close()
    assert corpus.search("voles", k=1, mode="lexical") == [] or "voles" not in corpus.text(corpus.search("voles", k=1, mode="lexical")[0][0])
    assert corpus.refresh()
    assert "voles" in corpus.text(corpus.search("voles", k=1, mode="lexical")[0][0])


def _open(path: Path) -> tuple[Corpus, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = Corpus.open(path, FakeEngine(), embedder=FakeEmbedder())
    return c, [str(w.message) for w in caught if issubclass(w.category, CorpusWarning)]


def test_a_missing_lexical_index_is_built_once_saved_and_said(corpus: Corpus) -> None:
    corpus.close()
    shutil.rmtree(corpus.path / "lexical")  # as a corpus made before hybrid retrieval has none
    c, said = _open(corpus.path)
    assert len(said) == 1 and "before hybrid retrieval" in said[0] and "saved" in said[0]
    assert (corpus.path / "lexical" / "lexical.json").is_file() and c.search("journal_mode", k=1, mode="lexical")
    c.close()
    c, said = _open(corpus.path)
    assert said == []  # saved: the next open loads it
    c.close()


@pytest.mark.parametrize("damage, garbage", [("lexical.json", b"\x00garbage"), ("lexical.json", b"[2]"),
                                             ("ids.npy", b"\x00garbage"), ("vocab.index.json", b"\x00garbage"),
                                             ("headings/vocab.index.json", b"\x00garbage")])
def test_a_damaged_lexical_index_is_rebuilt_with_a_warning_and_saved(corpus: Corpus, damage: str, garbage: bytes) -> None:
    corpus.close()
    (corpus.path / "lexical" / damage).write_bytes(garbage)
    c, said = _open(corpus.path)
    assert len(said) == 1 and "damaged" in said[0] and "rebuilt the lexical (BM25) index" in said[0]
    assert "journal_mode" in c.text(c.search("journal_mode", k=1, mode="lexical")[0][0])
    c.close()
    assert _open(corpus.path)[1] == []


def test_a_lexical_index_of_the_format_before_headings_is_rebuilt_with_them_and_saved(corpus: Corpus) -> None:
    corpus.close()
    meta = corpus.path / "lexical" / "lexical.json"
    meta.write_text(meta.read_text().replace('"format": 2', '"format": 1'))
    shutil.rmtree(corpus.path / "lexical" / "headings")  # as the earlier version saved it
    c, said = _open(corpus.path)
    assert len(said) == 1 and "another format (1; this version reads 2" in said[0] and "and saved" in said[0]
    assert LexicalIndex.load(corpus.path / "lexical")[0].search_names("journal_mode", 1) == []  # loads: saved whole
    c.close()
    assert _open(corpus.path)[1] == []


def test_a_deleted_vector_index_is_rebuilt_once_saved_and_said(corpus: Corpus) -> None:
    n = len(corpus)
    corpus.close()
    (corpus.path / "index.faiss").unlink()
    c, said = _open(corpus.path)
    assert len(c) == n and len(said) == 1 and "index.faiss is missing" in said[0] and "saved" in said[0]
    assert (corpus.path / "index.faiss").is_file()
    c.close()
    c, said = _open(corpus.path)
    assert said == [] and len(c) == n
    c.close()


def test_an_interrupted_ingest_leaves_the_lexical_index_behind_and_the_next_one_catches_up(tmp_path: Path) -> None:
    docs = write_docs(tmp_path / "docs", DOCS)

    def stop(num_modules: int, _tokens: int) -> None:
        if num_modules >= 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Corpus.build([docs], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(), chunk_tokens=32, overlap=8,
                     progress=False, on_batch=stop)
    c, said = _open(tmp_path / "c")
    assert said == [] and len(c.lexical) == len(c)  # behind the table: rebuilt in memory without a word
    c.add([docs], progress=False)
    _, saved = LexicalIndex.load(c.path / "lexical")
    assert saved == c.table.generation and len(c.lexical) == len(c)
    c.close()


def test_an_empty_lexical_index_saves_and_loads(tmp_path: Path) -> None:
    empty = LexicalIndex(np.zeros(0, np.int64), [])
    empty.save(tmp_path / "lex", 3)
    loaded, generation = LexicalIndex.load(tmp_path / "lex")
    assert generation == 3 and len(loaded) == 0 and loaded.search("anything", 4) == []


# An API reference names each subject in a heading; other sections name it in their text, more often.
API_DOCS = {"events.md": "# Events\n\n"
            "## `emitter.once(eventName, listener)`\n\nAdds a one-time listener. Unlike events.once, which "
            "waits on a promise, emitter.once calls back; use events.once to await it, emitter.once to listen.\n\n"
            "## `events.once(emitter, name)`\n\nCreates a Promise that is fulfilled when the emitter emits "
            "the given event, or rejected on an error.\n\n"
            "## `nodeEventTarget.once(type, listener)`\n\nAdds a one-time listener for the type. As with "
            "events.once and emitter.once, the listener runs at most once; events.once returns a promise.\n\n"}


def test_a_question_naming_an_identifier_finds_the_section_whose_heading_names_it(tmp_path: Path) -> None:
    c = build(write_docs(tmp_path / "docs", API_DOCS), tmp_path / "c")
    question, wanted = "What does events.once return?", "`events.once(emitter, name)`"
    section = lambda hits: c.metadata(hits[0][0])["section"]  # noqa: E731
    assert section(c.search(question, k=1)) == wanted
    # the text alone ranks the sections that mention it more often above it; the headings' ranking puts it first
    assert section(c.search(question, k=1, mode="lexical")) != wanted
    named = c.lexical.search_names(question, 50)
    assert {c.metadata(m)["section"] for m in c.table.module_ids_for([i for i, _ in named]).values()} == {wanted}
    c.close()


def test_only_identifiers_are_looked_up_and_only_in_headings(corpus: Corpus) -> None:
    assert corpus.search("Which pragma sets journal_mode?", k=1, mode="lexical")  # in a text
    assert corpus.lexical.search_names("Which pragma sets journal_mode?", 3) == []  # no heading holds it
    assert corpus.lexical.search_names("how does Sync work", 3) == []  # a heading's word, but no identifier
    assert corpus.lexical.search_names("in-memory keep-index", 3) == []  # nor is a hyphenated word
