"""What an answer through LangChain shares with `ask`: a question the window cannot take raises by name,
sources name the section (`file › section`), and the answer defaults are `ask`'s (one record,
`rag.repetition.ANSWER_DEFAULTS`). The real engine runs; a wrapper records what each path asked of it
and generates two tokens (`asked`, conftest.py)."""

from __future__ import annotations

import pytest
from rag_promptcache.engine.errors import ContextWindowExceeded, QuestionTooLong
from rag_promptcache.rag.prompts import ANSWER_DEFAULTS
from rag_promptcache.rag.repetition import repeated_sentence

from langchain_rag_promptcache import ChatPromptCache, PromptCacheLLM, PromptCacheRetriever

pytestmark = pytest.mark.smollm
LONG = " ".join(["word"] * 9000)  # 45,000 characters, 9,000 tokens: past SmolLM2's 8,192-token window


def test_a_question_past_the_window_raises_by_name(corpus):
    with pytest.raises(QuestionTooLong, match="the question is 9000 tokens, too long for the model's 8192-token"):
        ChatPromptCache(corpus=corpus).invoke(LONG)
    with pytest.raises(ContextWindowExceeded, match="past the model's 8192-token context window"):
        PromptCacheLLM(corpus=corpus).invoke(LONG)


def test_documents_and_sources_name_the_section(engine, tmp_path):
    from rag_promptcache.rag import Corpus

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "tower.md").write_text("## Eiffel Tower\n\nThe Eiffel Tower is in Paris. "
                                               "It was completed in 1889.")
    md = Corpus.build([tmp_path / "docs"], tmp_path / "c", engine=engine, progress=False)
    doc = PromptCacheRetriever(corpus=md, k=1).invoke("When was the Eiffel Tower completed?")[0]
    assert (doc.metadata["source"], doc.metadata["where"]) == ("tower.md", "tower.md › Eiffel Tower")
    assert doc.metadata["where"] == "tower.md › Eiffel Tower"
    out = ChatPromptCache(corpus=md, k=1, max_tokens=2).invoke("When was the Eiffel Tower completed?")
    source = out.response_metadata["sources"][0]
    assert (source["where"], source["section"]) == ("tower.md › Eiffel Tower", "Eiffel Tower")
    assert source["snippet"].startswith("The Eiffel Tower is in Paris.")


def _same(options: dict) -> dict:
    return {k: v for k, v in options.items() if not (k == "stop" and not v)}  # no stop strings, however spelt


def test_the_answer_defaults_are_asks(corpus, asked):
    asked.cap = 2  # what was asked is checked, not the answers
    question = "When was the Eiffel Tower completed?"
    first = len(asked)
    corpus.ask(question)
    ask = _same(asked[first])
    assert ask == {"max_new_tokens": ANSWER_DEFAULTS.max_new_tokens, "temperature": ANSWER_DEFAULTS.temperature,
                   "no_repeat_ngram": ANSWER_DEFAULTS.no_repeat_ngram, "stop_when": repeated_sentence}
    first = len(asked)
    PromptCacheLLM(corpus=corpus).invoke(question)
    assert _same(asked[first]) == ask
    first = len(asked)
    ChatPromptCache(corpus=corpus).invoke(question)
    assert _same(asked[first]) == ask
    # the one knob: the length; the repetition stop can be turned off where a user wants every sentence
    first = len(asked)
    PromptCacheLLM(corpus=corpus, max_tokens=64, stop_repeats=False).invoke(question)
    assert asked[first]["max_new_tokens"] == 64 and "stop_when" not in asked[first]
