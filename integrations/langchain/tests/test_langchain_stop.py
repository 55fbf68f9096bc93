"""A bare stop string is one stop string through the LangChain adapters, never its characters."""

from __future__ import annotations

from langchain_core.messages import HumanMessage

from langchain_rag_promptcache import ChatPromptCache, PromptCacheLLM
import pytest

pytestmark = pytest.mark.smollm

NEVER = "zzzz-never"  # its letters occur in the answers; the string itself never does


def test_llm_takes_a_bare_stop_string(corpus):
    llm = PromptCacheLLM(corpus=corpus, max_tokens=10)
    plain = llm.invoke("The capital of France is")
    assert set(plain) & set(NEVER)
    assert llm.invoke("The capital of France is", stop=NEVER) == plain


def test_chat_model_takes_a_bare_stop_string(corpus):
    chat = ChatPromptCache(corpus=corpus, max_tokens=10)
    question = [HumanMessage("Which city is the Eiffel Tower in?")]
    plain = chat.invoke(question).content
    assert set(plain) & set(NEVER)
    assert chat.invoke(question, stop=NEVER).content == plain
