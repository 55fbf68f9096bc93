"""langchain-tests' standard suites for ChatPromptCache and PromptCacheRetriever on the real SmolLM2."""

from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests, RetrieversIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests
from lc_shared import corpus, engine

from langchain_rag_promptcache import ChatPromptCache, PromptCacheRetriever, format_modules
import pytest

pytestmark = pytest.mark.smollm


class _Capabilities:
    """A local text model: no tools, no structured output, no JSON mode, text content only."""

    @property
    def chat_model_class(self) -> type[ChatPromptCache]:
        return ChatPromptCache

    @property
    def chat_model_params(self) -> dict:
        return {"engine": engine()}

    @property
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": 12}  # not 100: ~30 ms/token on 2 CPU cores

    has_tool_calling = False
    has_tool_choice = False
    has_structured_output = False
    supports_json_mode = False
    supports_image_inputs = False
    supports_image_urls = False
    supports_pdf_inputs = False
    supports_audio_inputs = False
    supports_video_inputs = False
    supports_image_tool_message = False
    supports_pdf_tool_message = False
    supports_anthropic_inputs = False
    returns_usage_metadata = True


class TestChatPromptCacheUnit(_Capabilities, ChatModelUnitTests):
    pass


class TestChatPromptCacheIntegration(_Capabilities, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict:
        # test_stop_sequence builds a model from these alone; the unit suite's test_standard_params
        # passes max_tokens beside them, so only here
        return {"engine": engine(), "max_tokens": 12}

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        docs = PromptCacheRetriever(corpus=corpus(), k=2).invoke("Where is the Eiffel Tower?")
        model = ChatPromptCache(corpus=corpus(), max_tokens=8)
        messages = [SystemMessage(format_modules(docs)), HumanMessage("Where is the Eiffel Tower?")]
        if not stream:
            return model.invoke(messages)
        full = None
        for chunk in model.stream(messages):
            full = chunk if full is None else full + chunk
        return full


class TestPromptCacheRetriever(RetrieversIntegrationTests):
    @property
    def retriever_constructor(self) -> type[PromptCacheRetriever]:
        return PromptCacheRetriever

    @property
    def retriever_constructor_params(self) -> dict:
        return {"corpus": corpus()}

    @property
    def retriever_query_example(self) -> str:
        return "When was Python first released?"
