"""One retrieval per conversation turn (`Corpus.retrieve_turns`, rag/retrieval.py `Conversations`):
`Corpus.ask` with history and `CorpusChat` both use it, each user turn searches once, and the modules,
their order and the prompts are those of retrieving every turn afresh (the rule before it: each
earlier turn's text counted against the window)."""

from __future__ import annotations

import pytest

from rag_promptcache.engine.errors import ContextWindowExceeded
from rag_promptcache.rag.chat import CorpusChat
from rag_promptcache.rag.prompts import build_prompt
from rag_promptcache.rag import retrieval
from rag_promptcache.rag.retrieval import keep_order
from tests.test_prefix_cache import tiny_corpus  # noqa: F401 - the fixture

LONG = " ".join(f"w{i}" for i in range(60))
HISTORY = [("How long do cats sleep?", "Sixteen hours."), ("What makes sourdough rise?", LONG)]
QUESTION = "When do spring tides come?"
K = 4


def tight(corpus) -> int:
    """A max_new_tokens at which the question fits fewer modules after HISTORY than alone: the long
    answer takes their room, so the window rule decides what this turn imports."""
    found = corpus.search(QUESTION, K)  # searched once; the window fitting alone is tried per size

    def count(text: str) -> int:
        return len(corpus.engine.tokenizer.encode(text, add_special_tokens=False))

    sizes = [corpus.table.module(m)[1] for m, _ in found]  # (text, tokens)
    window = corpus.engine.context_window

    def fitted(history, max_new: int) -> int:
        return len(retrieval.fit(found, sizes, count, instructions=corpus.manifest.instructions, question=QUESTION,
                                 history=history, max_new=max_new, window=window))

    for max_new in range(window, 0, -5):
        try:
            after = fitted(HISTORY, max_new)
        except ContextWindowExceeded:
            continue
        # two modules fewer: the fit's slack (a module's size) covers its estimate of the chat markup
        if after <= fitted([], max_new) - 2:
            return max_new
    raise AssertionError("no max_new_tokens makes the history count")


def afresh(corpus, history, question, max_new):
    """Every turn's retrieval run again, as `ask` did before `retrieve_turns`: hits, import order."""
    hits = corpus.retrieve(question, K, history=history, max_new_tokens=max_new)
    earlier = [corpus.retrieve(u, K, history=history[:i], max_new_tokens=max_new) for i, (u, _) in enumerate(history)]
    return hits, keep_order([[h.module_id for h in r] for r in [*earlier, hits]])


@pytest.fixture
def searches(tiny_corpus, monkeypatch):  # noqa: F811
    """Questions embedded (one per search) while a test runs."""
    seen: list[str] = []
    embedder = tiny_corpus.embedder
    real = embedder.embed

    def counted(texts):
        seen.extend(texts)
        return real(texts)

    monkeypatch.setattr(embedder, "embed", counted)
    return seen


def test_chat_retrieves_as_afresh_once_per_turn_where_history_takes_the_room(tiny_corpus, searches):  # noqa: F811
    max_new = tight(tiny_corpus)
    want_hits, want_order = afresh(tiny_corpus, HISTORY, QUESTION, max_new)
    searches.clear()
    turns = [t for u, a in HISTORY for t in (("user", u), ("assistant", a))] + [("user", QUESTION)]
    got = tiny_corpus.retrieve_turns(turns, K, max_new_tokens=max_new)
    assert list(got.hits) == want_hits and list(got.order) == want_order
    assert len(searches) == 3  # each user turn once
    searches.clear()  # the same conversation as the server's chat: only the question is searched again
    cp = CorpusChat(tiny_corpus).chat_prompt(turns, k=K, max_new_tokens=max_new)
    assert cp.prompt == build_prompt(turns, corpus=tiny_corpus, module_ids=want_order)
    assert [s.module_id for s in cp.sources] == [h.module_id for h in want_hits]
    assert searches == [QUESTION]


def test_ask_with_history_retrieves_as_afresh_once_per_turn(tiny_corpus, searches):  # noqa: F811
    history: list[tuple[str, str]] = []
    for q in ["How long do cats sleep?", "What makes sourdough rise?", QUESTION]:
        want_hits, want_order = afresh(tiny_corpus, history, q, 8)
        searches.clear()
        answer = tiny_corpus.ask(q, K, history=history, max_new_tokens=8)
        assert answer.prompt == tiny_corpus.prompt(q, tiny_corpus.order(want_order), history)
        assert answer.module_ids == tuple(h.module_id for h in want_hits)
        assert answer.scores == pytest.approx([h.score for h in want_hits], abs=1e-4)
        assert searches == [q]  # earlier turns' retrievals are remembered
        history.append((q, answer.answer))


def test_a_system_turn_counts_against_the_window_like_any_other(tiny_corpus):  # noqa: F811
    max_new = tight(tiny_corpus)
    turns = [("system", LONG), ("user", QUESTION)]
    alone = tiny_corpus.retrieve_turns([("user", QUESTION)], K, max_new_tokens=max_new)
    with_system = tiny_corpus.retrieve_turns(turns, K, max_new_tokens=max_new)
    assert len(with_system.hits) < len(alone.hits)
    assert list(with_system.hits) == tiny_corpus.retrieve(QUESTION, K, history=[(LONG, "")], max_new_tokens=max_new)
