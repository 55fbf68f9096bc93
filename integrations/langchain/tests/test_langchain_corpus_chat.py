"""`ChatPromptCache(corpus=...)` answers from its corpus: it retrieves `k` chunks for the question and
imports their modules (sources in the metadata, labelled as the CLI and server label them); `k=0`
leaves it to the caller; `min_score` answers "Not found in the documents." without generating. The
retriever labels sources the same way and takes `min_score` too."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from langchain_rag_promptcache import ChatPromptCache, PromptCacheRetriever
from rag_promptcache.rag.retrieval import NOT_FOUND

pytestmark = pytest.mark.smollm


class Completion(BaseModel):
    year: int


def test_the_chat_model_retrieves_from_its_corpus(corpus):
    reply = ChatPromptCache(corpus=corpus, max_tokens=24).invoke("When was the Eiffel Tower completed?")
    meta = reply.response_metadata
    assert "1889" in reply.content
    assert meta["sources"][0]["source"] == "fact0.txt" and len(meta["sources"]) == 4  # k=4 by default
    assert len(meta["hit_modules"]) == 4 and reply.usage_metadata["input_token_details"]["cache_read"] > 0
    structured = ChatPromptCache(corpus=corpus, max_tokens=24, k=2).with_structured_output(Completion)
    assert structured.invoke("In which year was the Eiffel Tower completed?").year == 1889
    alone = ChatPromptCache(corpus=corpus, max_tokens=4, k=0).invoke("When was the Eiffel Tower completed?")
    assert alone.response_metadata["sources"] == [] and alone.response_metadata["hit_modules"] == ()
    assert alone.usage_metadata["input_tokens"] < reply.usage_metadata["input_tokens"] / 2


def test_streaming_keeps_the_sources(corpus):
    chunks = list(ChatPromptCache(corpus=corpus, max_tokens=8, k=1).stream("Who created Python?"))
    assert chunks[-1].response_metadata["sources"][0]["source"] == "fact3.txt"


def test_min_score_answers_not_found_without_generating(corpus):
    reply = ChatPromptCache(corpus=corpus, min_score=0.99).invoke("What is the price of tea in Peru?")
    assert reply.content == NOT_FOUND and reply.response_metadata["path"] == "none"
    assert reply.usage_metadata["output_tokens"] == 0 and reply.response_metadata["sources"] == []
    assert PromptCacheRetriever(corpus=corpus, min_score=0.99).invoke("What is the price of tea in Peru?") == []
    docs = PromptCacheRetriever(corpus=corpus, k=1).invoke("Which city is the Eiffel Tower in?")
    assert docs[0].metadata["source"] == "fact0.txt"  # the label the CLI and the server show, not a path
    with pytest.raises(ValueError):
        ChatPromptCache(corpus=corpus, min_score=2)
