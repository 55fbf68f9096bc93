"""Call options as the README states them (issue 25, items 9 and 13): `max_new_tokens=` is another
name for `max_tokens=` at call time too, and every call gets the CLI's repetition control unless it
says otherwise. The real engine runs; a wrapper records what the adapter asked of it."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage
from rag_promptcache.rag.prompts import DEFAULT_NO_REPEAT_NGRAM
from rag_promptcache.rag.repetition import DEFAULT_NO_REPEAT_NGRAM as SHARED

from langchain_rag_promptcache import ChatPromptCache, PromptCacheLLM

pytestmark = pytest.mark.smollm


@pytest.mark.parametrize("cls", [PromptCacheLLM, ChatPromptCache])
def test_max_new_tokens_at_call_time(engine, asked, cls):
    out = cls(engine=engine).invoke("Write a long story about a cat.", max_new_tokens=5)
    assert asked[-1]["max_new_tokens"] == 5
    text = out if isinstance(out, str) else out.content
    assert len(engine.tokenizer(text, add_special_tokens=False).input_ids) <= 6  # 5, give or take a re-tokenized space
    with pytest.raises(ValueError, match="disagree"):
        cls(engine=engine).invoke("hi", max_tokens=4, max_new_tokens=5)


@pytest.mark.parametrize("cls", [PromptCacheLLM, ChatPromptCache])
def test_repetition_control_is_on_by_default_and_overridable(engine, asked, cls):
    assert DEFAULT_NO_REPEAT_NGRAM == SHARED == 6
    cls(engine=engine, max_tokens=2).invoke([HumanMessage("hi")] if cls is ChatPromptCache else "hi")
    assert asked[-1]["no_repeat_ngram"] == DEFAULT_NO_REPEAT_NGRAM
    cls(engine=engine, max_tokens=2, no_repeat_ngram=0).invoke("hi")
    assert asked[-1]["no_repeat_ngram"] == 0
    cls(engine=engine, max_tokens=2).invoke("hi", no_repeat_ngram=3)
    assert asked[-1]["no_repeat_ngram"] == 3


def test_with_structured_output_returns_a_validated_object(engine):
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    city = ChatPromptCache(engine=engine, max_tokens=48).with_structured_output(City).invoke(
        "Give the name and the country of the capital of France.")
    assert isinstance(city, City) and city.name and city.country
    as_dict = ChatPromptCache(engine=engine, max_tokens=48).with_structured_output(City.model_json_schema()).invoke(
        "Give the name and the country of the capital of France.")
    assert set(as_dict) == {"name", "country"}
    with pytest.raises(ValueError, match="method='json_schema' only"):
        ChatPromptCache(engine=engine).with_structured_output(City, method="function_calling")
    # a budget that cuts the JSON off is named as the cause, not reported as JSON the parser cannot read
    from langchain_core.exceptions import OutputParserException

    with pytest.raises(OutputParserException, match=r"reached max_tokens \(3 tokens\) before its JSON was complete"):
        ChatPromptCache(engine=engine, max_tokens=3).with_structured_output(City).invoke(
            "Give the name and the country of the capital of France.")
