"""LangChain's side of what an answer through an adapter shares with `ask` (tests/adapter_shared.py):
`ChatPromptCache`, `PromptCacheLLM` and `PromptCacheRetriever` on the real engine, whose calls a wrapper
records, each cut to two tokens (`asked`)."""

from __future__ import annotations

import pytest
from rag_promptcache.engine.errors import ContextWindowExceeded, QuestionTooLong

from langchain_rag_promptcache import ChatPromptCache, PromptCacheLLM, PromptCacheRetriever
from tests.adapter_shared import LONG, QUESTION, ask_defaults, options_of, tower_corpus

pytestmark = pytest.mark.smollm


def test_a_question_past_the_window_raises_by_name(corpus):
    with pytest.raises(QuestionTooLong, match="the question is 9000 tokens, too long for the model's 8192-token"):
        ChatPromptCache(corpus=corpus).invoke(LONG)
    with pytest.raises(ContextWindowExceeded, match="past the model's 8192-token context window"):
        PromptCacheLLM(corpus=corpus).invoke(LONG)


def test_documents_and_sources_name_the_section(tmp_path):
    md = tower_corpus(tmp_path)
    doc = PromptCacheRetriever(corpus=md, k=1).invoke(QUESTION)[0]
    assert (doc.metadata["source"], doc.metadata["where"]) == ("tower.md", "tower.md › Eiffel Tower")
    assert doc.metadata["where"] == "tower.md › Eiffel Tower"
    out = ChatPromptCache(corpus=md, k=1, max_tokens=2).invoke(QUESTION)
    source = out.response_metadata["sources"][0]
    assert (source["where"], source["section"]) == ("tower.md › Eiffel Tower", "Eiffel Tower")
    assert source["snippet"].startswith("The Eiffel Tower is in Paris.")


def test_the_answer_defaults_are_asks(corpus, asked):
    asked.cap = 2  # what was asked is checked, not the answers
    ask = ask_defaults(corpus, asked)
    assert options_of(asked, lambda: PromptCacheLLM(corpus=corpus).invoke(QUESTION)) == ask
    assert options_of(asked, lambda: ChatPromptCache(corpus=corpus).invoke(QUESTION)) == ask
    # the one knob: the length; the repetition stop can be turned off where a user wants every sentence
    first = len(asked)
    PromptCacheLLM(corpus=corpus, max_tokens=64, stop_repeats=False).invoke(QUESTION)
    assert asked[first]["max_new_tokens"] == 64 and "stop_when" not in asked[first]
