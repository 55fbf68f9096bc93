"""`PromptCacheRetriever` with LangChain's vector-store filter (`search_kwargs={"filter": ...}`, or per call):
only matching chunks, k of them whenever k match, each `Document` carrying its chunk's metadata; what the
retriever does not implement is refused by name. Over the session's corpus of five facts (objects whose
metadata names their source)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from langchain_rag_promptcache import PromptCacheRetriever

pytestmark = pytest.mark.smollm
QUESTION = "Which city is the Eiffel Tower in?"


def test_search_kwargs_filter_narrows_the_search(corpus) -> None:
    unfiltered = PromptCacheRetriever(corpus=corpus, k=1).invoke(QUESTION)
    assert unfiltered[0].metadata["source"] == "fact0.txt"
    docs = PromptCacheRetriever(corpus=corpus, search_kwargs={"filter": {"source": "fact3.txt"}}).invoke(QUESTION)
    assert [d.metadata["source"] for d in docs] == ["fact3.txt"] and "Guido" in docs[0].page_content
    assert docs[0].metadata["type"] == "object" and docs[0].metadata["module_id"] == docs[0].id
    wide = PromptCacheRetriever(corpus=corpus, search_kwargs={"k": 3, "filter": {"source": {"$in": ["fact1.txt", "fact2.txt", "fact4.txt"]}}})
    assert sorted(d.metadata["source"] for d in wide.invoke(QUESTION)) == ["fact1.txt", "fact2.txt", "fact4.txt"]
    # per call, as a vector store's retriever takes them
    per_call = wide.invoke(QUESTION, k=1, filter={"source": {"$glob": "fact[0-1].txt"}})
    assert [d.metadata["source"] for d in per_call] == ["fact0.txt"]
    assert PromptCacheRetriever(corpus=corpus, search_kwargs={"filter": {"source": "nothing.txt"}}).invoke(QUESTION) == []


def test_what_the_retriever_does_not_implement_is_refused_by_name(corpus) -> None:
    with pytest.raises(ValidationError, match="unsupported key\\(s\\) fetch_k, lambda_mult; valid: k, filter"):
        PromptCacheRetriever(corpus=corpus, search_kwargs={"fetch_k": 20, "lambda_mult": 0.5})
    with pytest.raises(ValidationError, match="search_type"):
        PromptCacheRetriever(corpus=corpus, search_type="mmr")  # accepted and ignored before; refused now
    with pytest.raises(ValueError, match="unknown filter key\\(s\\) 'author'; valid: section, source, title, type"):
        PromptCacheRetriever(corpus=corpus, search_kwargs={"filter": {"author": "x"}}).invoke(QUESTION)
