"""LlamaIndex's side of what an answer through an adapter shares with `ask` (tests/adapter_shared.py):
`PromptCacheLLM`, `PromptCacheQueryEngine` and the retriever's nodes on the real engine, whose calls a
wrapper records, each cut to two tokens (`asked`)."""

from __future__ import annotations

import pytest
from llama_index.llms.rag_promptcache import PromptCacheLLM, PromptCacheQueryEngine
from llama_index.retrievers.rag_promptcache import PromptCacheRetriever, corpus_nodes
from rag_promptcache.engine.errors import ContextWindowExceeded

from tests.adapter_shared import LONG, QUESTION, ask_defaults, options_of, tower_corpus

pytestmark = pytest.mark.smollm


def test_a_question_past_the_window_raises_by_name(corpus):
    with pytest.raises(ContextWindowExceeded, match="8192-token context window"):
        PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2).query(LONG)
    with pytest.raises(ContextWindowExceeded, match="8192-token context window"):
        PromptCacheLLM(corpus=corpus).complete(LONG)


def test_nodes_name_the_section(tmp_path):
    md = tower_corpus(tmp_path)
    node = PromptCacheRetriever(md, similarity_top_k=1).retrieve(QUESTION)[0].node
    assert (node.metadata["source"], node.metadata["where"]) == ("tower.md", "tower.md › Eiffel Tower")
    assert node.metadata["where"] == "tower.md › Eiffel Tower"
    stock = corpus_nodes(md)[0]
    assert stock.metadata["where"] == "tower.md › Eiffel Tower"
    from llama_index.core.schema import MetadataMode

    assert "Eiffel Tower" not in stock.get_content(MetadataMode.LLM).split(">", 1)[0]  # the reference tag holds the id only


def test_the_answer_defaults_are_asks(corpus, asked):
    asked.cap = 2  # what was asked is checked, not the answers
    ask = ask_defaults(corpus, asked)
    assert options_of(asked, lambda: PromptCacheLLM(corpus=corpus).complete(QUESTION)) == ask
    assert options_of(asked, lambda: PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2).query(QUESTION)) == ask
    first = len(asked)
    PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2, max_tokens=64).query(QUESTION)  # the one knob
    assert asked[first]["max_new_tokens"] == 64
