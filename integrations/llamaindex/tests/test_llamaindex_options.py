"""Call options as the README states them (issue 25, items 9 and 13): `max_new_tokens=` is another
name for `max_tokens=` at call time too, and every call gets the CLI's repetition control unless it
says otherwise. The real engine runs; a wrapper records what the adapter asked of it."""

from __future__ import annotations

import pytest
from llama_index.core.llms import ChatMessage
from llama_index.llms.rag_promptcache import PromptCacheLLM
from rag_promptcache.rag.prompts import DEFAULT_NO_REPEAT_NGRAM

pytestmark = pytest.mark.smollm


def test_max_new_tokens_at_call_time(engine, asked):
    PromptCacheLLM(engine=engine).complete("Write a long story about a cat.", max_new_tokens=5)
    assert asked[-1]["max_new_tokens"] == 5


def test_repetition_control_is_on_by_default_and_overridable(engine, asked):
    llm = PromptCacheLLM(engine=engine, max_tokens=2)
    llm.complete("hi")
    assert asked[-1]["no_repeat_ngram"] == DEFAULT_NO_REPEAT_NGRAM
    llm.chat([ChatMessage(role="user", content="hi")])
    assert asked[-1]["no_repeat_ngram"] == DEFAULT_NO_REPEAT_NGRAM
    PromptCacheLLM(engine=engine, max_tokens=2, no_repeat_ngram=0).complete("hi")
    assert asked[-1]["no_repeat_ngram"] == 0
    list(llm.stream_complete("hi", no_repeat_ngram=3))
    assert asked[-1]["no_repeat_ngram"] == 3
