"""LlamaIndex's `MetadataFilters` on `PromptCacheRetriever` and `PromptCacheQueryEngine`: translated to the
core's filter (`to_filter`) and applied inside the search; operators and conditions without a counterpart
refused by name. Over the session's corpus of five facts (objects whose metadata names their source)."""

from __future__ import annotations

import pytest
from llama_index.core.vector_stores.types import FilterCondition, FilterOperator, MetadataFilter, MetadataFilters

from llama_index.llms.rag_promptcache import PromptCacheQueryEngine
from llama_index.retrievers.rag_promptcache import PromptCacheRetriever
from llama_index.retrievers.rag_promptcache.base import to_filter

QUESTION = "Which city is the Eiffel Tower in?"


def _f(key: str, value: object, op: FilterOperator = FilterOperator.EQ) -> MetadataFilter:
    return MetadataFilter(key=key, value=value, operator=op)


def test_metadata_filters_translate_to_the_core_filter() -> None:
    nested = MetadataFilters(filters=[_f("year", 2020, FilterOperator.GTE),
                                      MetadataFilters(filters=[_f("lang", ["en", "de"], FilterOperator.IN), _f("tags", "io", FilterOperator.CONTAINS)],
                                                      condition=FilterCondition.OR)])
    assert to_filter(nested) == {"$and": [{"year": {"$gte": 2020}},
                                          {"$or": [{"lang": {"$in": ["en", "de"]}}, {"tags": {"$eq": "io"}}]}]}
    assert to_filter(None) is None and to_filter(MetadataFilters(filters=[])) is None
    with pytest.raises(ValueError, match="filter operator 'text_match' on key 'title' is not supported; valid: ==, !=, >"):
        to_filter(MetadataFilters(filters=[_f("title", "Fuji", FilterOperator.TEXT_MATCH)]))
    with pytest.raises(ValueError, match="condition 'not' is not supported; valid: and, or"):
        to_filter(MetadataFilters(filters=[_f("source", "a")], condition=FilterCondition.NOT))


@pytest.mark.smollm
def test_the_retriever_and_the_query_engine_search_within_the_filters(corpus) -> None:
    assert PromptCacheRetriever(corpus, similarity_top_k=1).retrieve(QUESTION)[0].node.metadata["source"] == "fact0.txt"
    only = MetadataFilters(filters=[_f("source", "fact1.txt")])
    nodes = PromptCacheRetriever(corpus, similarity_top_k=2, filters=only).retrieve(QUESTION)
    assert [n.node.metadata["source"] for n in nodes] == ["fact1.txt"] and nodes[0].node.metadata["type"] == "object"
    either = MetadataFilters(filters=[_f("source", "fact2.txt"), _f("source", "fact3.txt")], condition=FilterCondition.OR)
    assert sorted(n.node.metadata["source"] for n in PromptCacheRetriever(corpus, similarity_top_k=4, filters=either).retrieve(QUESTION)) \
        == ["fact2.txt", "fact3.txt"]
    with pytest.raises(ValueError, match="unknown filter key\\(s\\) 'author'"):
        PromptCacheRetriever(corpus, filters=MetadataFilters(filters=[_f("author", "x")]))
    engine = PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2, filters=only, max_new_tokens=8)
    response = engine.query(QUESTION)
    assert [n.node.metadata["source"] for n in response.source_nodes] == ["fact1.txt"]
