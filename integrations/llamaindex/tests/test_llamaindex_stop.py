"""A bare stop string is one stop string through the LlamaIndex adapter, never its characters."""

from __future__ import annotations

from llama_index.core.llms import ChatMessage

from llama_index.llms.rag_promptcache import PromptCacheLLM
import pytest

pytestmark = pytest.mark.smollm

NEVER = "zzzz-never"  # its letters occur in the answers; the string itself never does


def test_complete_and_chat_take_a_bare_stop_string(corpus):
    llm = PromptCacheLLM(corpus=corpus, max_tokens=10)
    plain = llm.complete("The capital of France is").text
    assert set(plain) & set(NEVER)
    assert llm.complete("The capital of France is", stop=NEVER).text == plain
    messages = [ChatMessage(role="user", content="Which city is the Eiffel Tower in?")]
    answer = llm.chat(messages).message.content
    assert set(answer) & set(NEVER)
    assert llm.chat(messages, stop=NEVER).message.content == answer
