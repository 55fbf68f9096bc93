"""`PromptCacheLLM`: a LlamaIndex `CustomLLM` on a `PromptCache` engine.

`complete(prompt, module_ids=[…])` imports the named corpus modules' stored KV and makes the prompt
the user turn; without module ids a completion prompt is generated as is. `chat` renders messages
with the tokenizer's chat template. An id may come as `(id, text)`: if the corpus lacks the module,
its text is used instead. Text content only. Translation only."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen, CompletionResponse,
    CompletionResponseAsyncGen, CompletionResponseGen, LLMMetadata, TextBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from pydantic import AliasChoices, ConfigDict, Field, model_validator
from rag_promptcache.rag.prompts import ANSWER_DEFAULTS, ModuleRef, build_prompt, generation_options, result_stats, wants_chat

ROLES = ("system", "user", "assistant")


class PromptCacheLLM(CustomLLM):
    """`PromptCacheLLM(corpus=Corpus.open(dir))` or `PromptCacheLLM(engine=PromptCache.from_pretrained(…))`."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")  # a misspelt option is an error

    corpus: Any = None
    engine: Any = None
    model_name: str = ""
    # `ask`'s answer defaults, one record (rag.repetition.AnswerDefaults): the length is the knob to turn
    max_tokens: int = Field(default=ANSWER_DEFAULTS.max_new_tokens, gt=0,
                            validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    temperature: float = ANSWER_DEFAULTS.temperature
    no_repeat_ngram: int = Field(default=ANSWER_DEFAULTS.no_repeat_ngram, ge=0)  # zero turns it off
    stop_repeats: bool = ANSWER_DEFAULTS.stop_repeats  # end the answer before a sentence it repeats
    stop: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _bind(self) -> PromptCacheLLM:
        if self.engine is None and self.corpus is None:
            raise ValueError("pass corpus=Corpus.open(dir) or engine=PromptCache.from_pretrained(name)")
        self.engine = self.engine if self.engine is not None else self.corpus.engine
        self.model_name = self.model_name or self.engine.model_name
        return self

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.engine.context_window, num_output=self.max_tokens,
                           is_chat_model=True, model_name=self.model_name)

    # -- translation -------------------------------------------------------------------------------

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = {k: v for k, v in kwargs.items() if k != "formatted"}
        defaults = {"max_tokens": self.max_tokens, "temperature": self.temperature, "stop": self.stop,
                    "no_repeat_ngram": self.no_repeat_ngram, "stop_repeats": self.stop_repeats}
        return generation_options(defaults, kwargs)

    def _completion(self, prompt: str, module_ids: Sequence[ModuleRef]) -> Any:
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is text (str), got {type(prompt).__name__}")
        return build_prompt([("user", prompt)], corpus=self.corpus, module_ids=module_ids,
                            chat=bool(module_ids) or wants_chat(self.engine, prompt))

    def _chat(self, messages: Sequence[ChatMessage], module_ids: Sequence[ModuleRef]) -> Any:
        if not messages:
            raise ValueError("empty prompt: no messages")
        return build_prompt([_turn(m) for m in messages], corpus=self.corpus, module_ids=module_ids, chat=True)

    # -- completion and chat: engine Result / Stream → LlamaIndex responses ---------------------------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, module_ids: Sequence[ModuleRef] = (), **kwargs: Any) -> CompletionResponse:
        return _completion(self.engine.generate(self._completion(prompt, module_ids), **self._options(kwargs)))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, module_ids: Sequence[ModuleRef] = (), **kwargs: Any) -> CompletionResponseGen:
        return _deltas(self.engine.stream(self._completion(prompt, module_ids), **self._options(kwargs)), _completion)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, module_ids: Sequence[ModuleRef] = (), **kwargs: Any) -> CompletionResponse:
        return _completion(await self.engine.agenerate(self._completion(prompt, module_ids), **self._options(kwargs)))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, module_ids: Sequence[ModuleRef] = (), **kwargs: Any) -> CompletionResponseAsyncGen:
        return _adeltas(self.engine.astream(self._completion(prompt, module_ids), **self._options(kwargs)), _completion)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], module_ids: Sequence[ModuleRef] = (), **kwargs: Any) -> ChatResponse:
        return _chat(self.engine.generate(self._chat(messages, module_ids), **self._options(kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], module_ids: Sequence[ModuleRef] = (), **kwargs: Any) -> ChatResponseGen:
        return _deltas(self.engine.stream(self._chat(messages, module_ids), **self._options(kwargs)), _chat)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], module_ids: Sequence[ModuleRef] = (), **kwargs: Any) -> ChatResponse:
        return _chat(await self.engine.agenerate(self._chat(messages, module_ids), **self._options(kwargs)))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], module_ids: Sequence[ModuleRef] = (), **kwargs: Any) -> ChatResponseAsyncGen:
        return _adeltas(self.engine.astream(self._chat(messages, module_ids), **self._options(kwargs)), _chat)


def _completion(result: Any, text: str | None = None, delta: str | None = None) -> CompletionResponse:
    return CompletionResponse(text=result.text if text is None else text, delta=delta, raw=result_stats(result))


def _chat(result: Any, text: str | None = None, delta: str | None = None) -> ChatResponse:
    content = result.text if text is None else text
    return ChatResponse(message=ChatMessage(role="assistant", content=content), delta=delta, raw=result_stats(result))


def _deltas(stream: Any, make: Callable[..., Any]) -> Iterator[Any]:
    """Text pieces → cumulative responses; the last carries the engine's statistics in `raw`."""
    text = ""
    for piece in stream:
        text += piece
        yield make(None, text, piece)
    yield make(stream.result, text, "")


async def _adeltas(stream: Any, make: Callable[..., Any]) -> AsyncIterator[Any]:
    text = ""
    async for piece in stream:
        text += piece
        yield make(None, text, piece)
    yield make(stream.result, text, "")


def _turn(message: ChatMessage) -> tuple[str, str]:
    role = message.role.value
    if role not in ROLES:
        raise ValueError(f"unsupported message role {role!r}; valid: {', '.join(ROLES)}")
    for block in message.blocks:
        if not isinstance(block, TextBlock):
            raise ValueError(f"unsupported content block {type(block).__name__} in a {role} message; PromptCacheLLM takes text only")
    return role, "".join(b.text for b in message.blocks)
