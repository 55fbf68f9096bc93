"""PromptCacheLLM, PromptCacheRetriever and PromptCacheQueryEngine on the real SmolLM2."""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ImageBlock, TextBlock
from llama_index.core.llms import ChatMessage
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index.llms.rag_promptcache import ModuleSynthesizer, PromptCacheLLM, PromptCacheQueryEngine
from llama_index.retrievers.rag_promptcache import PromptCacheRetriever
from rag_promptcache.rag.prompts import build_prompt

pytestmark = pytest.mark.smollm

QUESTION = "Which city is the Eiffel Tower in?"


@pytest.fixture(scope="module")
def llm(corpus):
    return PromptCacheLLM(corpus=corpus, max_tokens=12)


def test_metadata(llm, engine):
    m = llm.metadata
    assert (m.context_window, m.model_name, m.is_chat_model, m.num_output) == (engine.context_window, engine.model_name, True, 12)
    assert PromptCacheLLM(engine=engine).metadata.context_window == engine.context_window


def test_complete_plain_text_is_the_user_turn_of_the_chat_template(llm, engine):
    user_turn = build_prompt([("user", "The capital of France is")], chat=True)
    assert llm.complete("The capital of France is").text == engine.generate(user_turn, max_new_tokens=12).text


def test_the_cli_name_max_new_tokens_is_an_alias_and_unknown_fields_are_errors(corpus):
    assert PromptCacheLLM(corpus=corpus, max_new_tokens=3).max_tokens == 3
    with pytest.raises(ValueError, match="max_new_tokenz"):
        PromptCacheLLM(corpus=corpus, max_new_tokenz=3)


def test_complete_with_module_ids_imports_them(llm, corpus):
    ids = [m for m, _ in corpus.search(QUESTION, 2)]
    response = llm.complete(QUESTION, module_ids=ids, max_tokens=16)
    assert "Paris" in response.text
    # ranked best first; imported best last, next to the question (Corpus.order)
    assert response.raw["hit_modules"] == tuple(corpus.order(ids)) and response.raw["cached_tokens"] > 0


def test_stream_complete_matches_complete(llm):
    responses = list(llm.stream_complete("One, two, three,"))
    assert "".join(r.delta for r in responses) == responses[-1].text == llm.complete("One, two, three,").text
    assert "ttft_s" in responses[-1].raw


def test_chat_and_stream_chat(llm):
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Say hello.")]
    reply = llm.chat(messages)
    assert reply.message.role.value == "assistant" and reply.message.content
    assert "".join(r.delta for r in llm.stream_chat(messages)) == reply.message.content


async def test_async_variants(llm):
    expected = llm.complete("One, two, three,").text
    assert (await llm.acomplete("One, two, three,")).text == expected
    assert "".join([r.delta async for r in await llm.astream_complete("One, two, three,")]) == expected
    messages = [ChatMessage(role="user", content="Say hello.")]
    # the first run computes the whole prompt and every later one reuses its KV (the prefix cache); in
    # bf16 those differ by rounding, which can turn a near tie (README, Limits): compare warm with warm
    llm.chat(messages)
    chat = llm.chat(messages).message.content
    assert (await llm.achat(messages)).message.content == chat
    assert "".join([r.delta async for r in await llm.astream_chat(messages)]) == chat


def test_retriever_node_ids_are_module_ids(corpus):
    nodes = PromptCacheRetriever(corpus, similarity_top_k=2).retrieve(QUESTION)
    assert len(nodes) == 2 and all(isinstance(n, NodeWithScore) for n in nodes)
    assert [n.node.node_id for n in nodes] == [m for m, _ in corpus.search(QUESTION, 2)]
    assert "Paris" in nodes[0].node.get_content() and nodes[0].score >= nodes[1].score
    assert len(PromptCacheRetriever(corpus, similarity_top_k=1).retrieve(QUESTION)) == 1


def test_query_engine(corpus, llm):
    engine = PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2, llm=llm)
    assert isinstance(engine, RetrieverQueryEngine)
    response = engine.query(QUESTION)
    assert "Paris" in str(response) and len(response.source_nodes) == 2


def test_query_engine_streaming(corpus, llm):
    engine = PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2, streaming=True, llm=llm)
    response = engine.query(QUESTION)
    pieces = list(response.response_gen)
    assert len(pieces) > 1 and "Paris" in "".join(pieces)


async def test_query_engine_async(corpus, llm):
    plain = await PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2, llm=llm).aquery(QUESTION)
    streamed = await PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2, streaming=True, llm=llm).aquery(QUESTION)
    assert "".join([p async for p in streamed.async_response_gen()]) == str(plain)


def test_plain_retriever_query_engine_with_the_module_synthesizer(corpus, llm):
    engine = RetrieverQueryEngine(PromptCacheRetriever(corpus, similarity_top_k=1), ModuleSynthesizer(llm=llm))
    assert "Paris" in str(engine.query(QUESTION))


# -- bad input ---------------------------------------------------------------------------------------


def test_unknown_module_falls_back_to_its_text(llm):
    response = llm.complete("What colour are bananas?", module_ids=[("mnotinthecorpus", "Bananas are yellow.")])
    assert response.raw["hit_modules"] == ()


def test_unknown_module_without_text_names_the_id(llm):
    with pytest.raises(ValueError, match="mnotinthecorpus"):
        llm.complete("What colour are bananas?", module_ids=["mnotinthecorpus"])


def test_synthesizer_falls_back_for_nodes_from_elsewhere(llm):
    node = NodeWithScore(node=TextNode(id_="not-a-module", text="Bananas are yellow."), score=1.0)
    response = ModuleSynthesizer(llm=llm).synthesize("What colour are bananas?", [node])
    assert str(response)


@pytest.mark.parametrize("prompt", ["", "  "])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.complete(prompt)


def test_empty_messages(llm):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.chat([])


def test_images_are_refused(llm):
    message = ChatMessage(role="user", blocks=[TextBlock(text="what is this?"), ImageBlock(url="http://x/y.png")])
    with pytest.raises(ValueError, match="ImageBlock"):
        llm.chat([message])


def test_max_tokens_must_be_positive(llm, engine):
    with pytest.raises(ValueError, match="max_tokens"):
        PromptCacheLLM(engine=engine, max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.complete("hi", max_tokens=0)


def test_needs_an_engine_or_a_corpus():
    with pytest.raises(ValueError, match="corpus=.*engine="):
        PromptCacheLLM()


def test_similarity_top_k_must_be_positive(corpus):
    with pytest.raises(ValueError, match="similarity_top_k"):
        PromptCacheRetriever(corpus, similarity_top_k=0)


def test_a_plain_vector_store_index_flow_reuses_the_corpus_kv(corpus, llm, engine):
    """Settings.llm + a stock VectorStoreIndex over `corpus_nodes`: the stock synthesizer's context
    arrives as module references, which the LLM imports (store hits), and the answer is right."""
    from llama_index.core import Settings, VectorStoreIndex

    from llama_index.retrievers.rag_promptcache import PromptCacheEmbedding, corpus_nodes

    old = Settings._llm, Settings._embed_model  # reading Settings.llm would build the default (OpenAI)
    Settings.llm, Settings.embed_model = llm, PromptCacheEmbedding(corpus)
    try:
        index = VectorStoreIndex(corpus_nodes(corpus))
        before = engine.store.stats().num_hits
        response = index.as_query_engine(similarity_top_k=2).query(QUESTION)
        assert engine.store.stats().num_hits - before >= 2  # both retrieved modules came from the store
        assert "Paris" in str(response) and {n.node.id_ for n in response.source_nodes} <= {m for m, _ in corpus.table.modules()}
        plain = VectorStoreIndex([TextNode(text=n.text, embedding=n.embedding) for n in corpus_nodes(corpus)])
        before = engine.store.stats().num_hits
        plain.as_query_engine(similarity_top_k=2).query(QUESTION)
        assert engine.store.stats().num_hits == before  # nodes from elsewhere: text, no KV reuse
    finally:
        Settings._llm, Settings._embed_model = old


def test_query_engine_metadata_has_the_engine_statistics_and_one_source_label(corpus, llm):
    response = PromptCacheQueryEngine(corpus=corpus, similarity_top_k=2, llm=llm).query(QUESTION)
    meta = response.metadata
    assert meta["ttft_s"] >= 0 and meta["cached_tokens"] > 0 and meta["path"] == "cached" and len(meta["hit_modules"]) == 2
    assert response.source_nodes[0].node.metadata["source"] == "fact0.txt"  # as the CLI and the server name it


def test_min_score_answers_not_found_without_generating(corpus, llm):
    from rag_promptcache.rag.retrieval import NOT_FOUND

    response = PromptCacheQueryEngine(corpus=corpus, llm=llm, min_score=0.99).query("What is the price of tea in Peru?")
    assert str(response) == NOT_FOUND and response.metadata["path"] == "none" and response.source_nodes == []
    assert PromptCacheRetriever(corpus, min_score=0.99).retrieve("What is the price of tea in Peru?") == []
