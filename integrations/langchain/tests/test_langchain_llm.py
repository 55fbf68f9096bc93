"""PromptCacheLLM (our own equivalents of the standard suite), the LCEL RAG chain with format_modules
(and the same chain on HuggingFacePipeline, the baseline), and bad input."""

from __future__ import annotations

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.rag.prompts import build_prompt

from langchain_rag_promptcache import ChatPromptCache, PromptCacheLLM, PromptCacheRetriever, format_modules

pytestmark = pytest.mark.smollm

PROMPT = PromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}\nAnswer:")
QUESTION = "Which city is the Eiffel Tower in?"


@pytest.fixture(scope="module")
def llm(corpus):
    return PromptCacheLLM(corpus=corpus, max_tokens=8)


def test_invoke_plain_text_is_the_user_turn_of_the_chat_template(llm, engine):
    text = llm.invoke("The capital of France is")
    user_turn = build_prompt([("user", "The capital of France is")], chat=True)
    assert text == engine.generate(user_turn, max_new_tokens=8).text
    assert llm.model_name == engine.model_name


def test_a_chat_model_answers_a_plain_prompt(corpus):
    story = PromptCacheLLM(corpus=corpus, max_new_tokens=24).invoke("Write a long story about a cat.")
    assert len(story.split()) >= 8 and "cat" in story.lower()  # was '' without the chat template


def test_the_cli_name_max_new_tokens_is_an_alias_and_unknown_fields_are_errors(corpus):
    assert PromptCacheLLM(corpus=corpus, max_new_tokens=3).max_tokens == 3
    assert ChatPromptCache(corpus=corpus, max_new_tokens=3).max_tokens == 3
    with pytest.raises(ValueError, match="max_new_tokenz"):
        PromptCacheLLM(corpus=corpus, max_new_tokenz=3)


def test_batch_keeps_order_and_stats(llm):
    out = llm.generate(["The capital of France is", "One, two, three,"])
    assert [len(g) for g in out.generations] == [1, 1]
    assert out.generations[0][0].text == llm.invoke("The capital of France is")
    info = out.generations[1][0].generation_info
    assert {"ttft_s", "cached_tokens", "computed_tokens", "missed_modules"} <= set(info)
    assert llm.batch(["One, two, three,"]) == [out.generations[1][0].text]


def test_stream_matches_invoke(llm):
    pieces = list(llm.stream("The capital of France is"))
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == llm.invoke("The capital of France is")


async def test_ainvoke_and_astream(llm):
    expected = llm.invoke("One, two, three,")
    assert await llm.ainvoke("One, two, three,") == expected
    assert "".join([p async for p in llm.astream("One, two, three,")]) == expected


def test_stop_strings_cut_before_the_stop(llm):
    full = llm.invoke("One, two, three,", max_tokens=12)
    cut = llm.invoke("One, two, three,", max_tokens=12, stop=[","])
    assert "," not in cut and full.startswith(cut)
    assert llm.generate(["One, two, three,"], stop=[","]).generations[0][0].generation_info["finish_reason"] == "stop"


def test_pml_prompt_imports_modules_and_plain_text_does_not(llm, corpus):
    [(module_id, _)] = corpus.search(QUESTION, 1)
    pml = llm.generate([prompt_pml(corpus.manifest.name, [module_id], [("user", QUESTION)])], max_tokens=12).generations[0][0]
    plain = llm.generate([corpus.text(module_id) + "\n" + QUESTION]).generations[0][0]
    assert pml.generation_info["cached_tokens"] > 0 and pml.generation_info["hit_modules"] == (module_id,)
    # a plain prompt imports no module (the chat template's system turn may still come from the store)
    assert plain.generation_info["hit_modules"] == () and plain.generation_info["cached_tokens"] < pml.generation_info["cached_tokens"]
    assert "Paris" in pml.text


def test_callbacks_receive_every_token(llm):
    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs) -> None:
            self.tokens.append(token)

    handler = Tokens()
    text = llm.invoke("The capital of France is", config={"callbacks": [handler]})
    assert len(handler.tokens) > 1 and "".join(handler.tokens) == text


def test_lcel_chain_imports_retrieved_modules(llm, corpus):
    retriever = PromptCacheRetriever(corpus=corpus, k=2)
    chain = {"context": retriever | format_modules, "question": RunnablePassthrough()} | PROMPT | llm.bind(max_tokens=24)
    assert "Paris" in chain.invoke(QUESTION)
    rendered = PROMPT.invoke({"context": format_modules(retriever.invoke(QUESTION)), "question": QUESTION}).to_string()
    info = llm.generate([rendered]).generations[0][0].generation_info
    assert len(info["hit_modules"]) == 2 and info["cached_tokens"] > 0 and info["missed_modules"] == ()


def test_same_chain_on_huggingface_pipeline(engine, corpus):
    from langchain_huggingface import HuggingFacePipeline
    from transformers import pipeline

    pipe = pipeline("text-generation", model=engine.model, tokenizer=engine.tokenizer, max_new_tokens=24,
                    do_sample=False, return_full_text=False)
    baseline = HuggingFacePipeline(pipeline=pipe)
    retriever = PromptCacheRetriever(corpus=corpus, k=2)
    chain = {"context": retriever | format_modules, "question": RunnablePassthrough()} | PROMPT | baseline | StrOutputParser()
    assert "Paris" in chain.invoke(QUESTION)


def test_chat_module_references_in_a_system_message(corpus):
    chat = ChatPromptCache(corpus=corpus, max_tokens=16)
    docs = PromptCacheRetriever(corpus=corpus, k=1).invoke(QUESTION)
    reply = chat.invoke([("system", format_modules(docs)), ("human", QUESTION)])
    assert "Paris" in reply.content
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
    assert reply.response_metadata["hit_modules"] == (docs[0].metadata["module_id"],)


# -- bad input ---------------------------------------------------------------------------------------


def test_unknown_module_falls_back_to_its_text(llm):
    info = llm.generate(['<module id="mnotinthecorpus">Bananas are yellow.</module>\nWhat colour are bananas?'])
    assert info.generations[0][0].generation_info["hit_modules"] == ()


def test_unknown_module_without_text_names_the_id(llm):
    with pytest.raises(ValueError, match="mnotinthecorpus"):
        llm.invoke('<module id="mnotinthecorpus"/>What colour are bananas?')


def test_format_modules_needs_module_ids():
    from langchain_core.documents import Document

    with pytest.raises(ValueError, match="module_id"):
        format_modules([Document(page_content="text")])


@pytest.mark.parametrize("prompt", ["", "   "])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="empty prompt"):
        llm.invoke(prompt)


def test_empty_messages(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        ChatPromptCache(engine=engine).invoke([])


def test_images_are_refused(engine):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ValueError, match="image_url"):
        ChatPromptCache(engine=engine).invoke([HumanMessage(content=[{"type": "text", "text": "what is this?"}, image])])


@pytest.mark.parametrize("cls", [PromptCacheLLM, ChatPromptCache])
def test_max_tokens_must_be_positive(engine, cls):
    with pytest.raises(ValueError, match="max_tokens"):
        cls(engine=engine, max_tokens=0)
    with pytest.raises(ValueError, match="max_tokens"):
        cls(engine=engine).invoke("hi", max_tokens=0)


def test_unknown_option_lists_the_valid_ones(llm):
    with pytest.raises(ValueError, match="max_tokens, temperature"):
        llm.invoke("hi", max_length=3)


def test_needs_an_engine_or_a_corpus():
    with pytest.raises(ValueError, match="corpus=.*engine="):
        PromptCacheLLM()
