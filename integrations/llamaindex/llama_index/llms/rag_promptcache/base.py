"""`PromptCacheLLM`: a LlamaIndex `CustomLLM` on a `PromptCache` engine.

`complete(prompt, module_ids=[…])` imports the named corpus modules' stored KV and makes the prompt
the user turn; without module ids a completion prompt is generated as is. `chat` renders messages
with the tokenizer's chat template. An id may come as `(id, text)`: if the corpus lacks the module,
its text is used instead. Text content only. Translation only."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage, ChatResponse, ChatResponseAsyncGen, ChatResponseGen, CompletionResponse,
    CompletionResponseAsyncGen, CompletionResponseGen, LLMMetadata, TextBlock,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from pydantic import ConfigDict, Field, model_validator
from rag_promptcache.pml import ast
from rag_promptcache.pml.build import prompt_pml

from llama_index.llms.rag_promptcache._engine import info as _info, pieces as _pieces, register as _register

ModuleRef = str | tuple[str, str]  # a module id, or (id, fallback text)
ROLES = ("system", "user", "assistant")


class PromptCacheLLM(CustomLLM):
    """`PromptCacheLLM(corpus=Corpus.open(dir))` or `PromptCacheLLM(engine=PromptCache.from_pretrained(…))`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    corpus: Any = None
    engine: Any = None
    model_name: str = ""
    max_tokens: int = Field(default=256, gt=0)
    temperature: float = 0.0
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

    def _prompt(self, turns: list[tuple[str, str]], module_ids: Sequence[ModuleRef], chat: bool) -> Any:
        imports, fallback = [], []
        for ref in module_ids:
            module_id, text = (ref, None) if isinstance(ref, str) else ref
            if self.corpus is not None and self.corpus.table.has_module(module_id):
                imports.append(module_id)
            elif text is not None:
                fallback.append(text)
            else:
                where = f"corpus {self.corpus.path}" if self.corpus is not None else "this engine (no corpus given)"
                raise ValueError(f"unknown module {module_id!r}: not in {where}, and no text to fall back on")
        if fallback:  # before the last turn's text, as retrieved context
            role, text = turns[-1]
            turns = [*turns[:-1], (role, "\n\n".join([*fallback, text]))]
        if not any(t.strip() for _, t in turns):
            raise ValueError("empty prompt")
        if imports:
            return prompt_pml(_register(self.corpus), dict.fromkeys(imports), turns)
        if not chat:
            return turns[-1][1]
        return ast.Prompt("", tuple(ast.Role(r, (ast.Text(t),)) for r, t in turns))  # the engine's empty schema

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        valid = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
        if unknown := set(kwargs) - set(valid) - {"formatted"}:
            raise ValueError(f"unsupported option(s) {sorted(unknown)}; valid: module_ids, {', '.join(valid)}")
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        out = {k: v for k, v in kwargs.items() if k in valid[2:5]}
        return {**out, "max_new_tokens": max_tokens, "temperature": kwargs.get("temperature", self.temperature),
                "stop": tuple(kwargs.get("stop", self.stop))}

    def _completion(self, prompt: str, module_ids: Sequence[ModuleRef]) -> Any:
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is text (str), got {type(prompt).__name__}")
        if self.corpus is not None and prompt.lstrip().startswith("<prompt"):
            _register(self.corpus)  # PML goes as is, and may name the corpus schema
        return self._prompt([("user", prompt)], module_ids, chat=bool(module_ids))

    def _chat(self, messages: Sequence[ChatMessage], module_ids: Sequence[ModuleRef]) -> Any:
        if not messages:
            raise ValueError("empty prompt: no messages")
        return self._prompt([_turn(m) for m in messages], module_ids, chat=True)

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
        stream = await asyncio.to_thread(self.engine.stream, self._completion(prompt, module_ids), **self._options(kwargs))
        return _adeltas(stream, _completion)

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
        stream = await asyncio.to_thread(self.engine.stream, self._chat(messages, module_ids), **self._options(kwargs))
        return _adeltas(stream, _chat)


def _completion(result: Any, text: str | None = None, delta: str | None = None) -> CompletionResponse:
    return CompletionResponse(text=result.text if text is None else text, delta=delta, raw=_info(result))


def _chat(result: Any, text: str | None = None, delta: str | None = None) -> ChatResponse:
    content = result.text if text is None else text
    return ChatResponse(message=ChatMessage(role="assistant", content=content), delta=delta, raw=_info(result))


def _deltas(stream: Any, make: Callable[..., Any]) -> Iterator[Any]:
    """Text pieces → cumulative responses; the last carries the engine's statistics in `raw`."""
    text = ""
    for piece in stream:
        text += piece
        yield make(None, text, piece)
    yield make(stream.result, text, "")


async def _adeltas(stream: Any, make: Callable[..., Any]) -> AsyncIterator[Any]:
    text = ""
    async for piece in _pieces(stream):
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
