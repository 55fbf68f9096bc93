"""`ChatPromptCache`: a LangChain `BaseChatModel` on a `PromptCache` engine, for chatbots.

Messages become (role, text) turns rendered with the tokenizer's chat template. With a corpus, the
last user message is the question: the `k` chunks nearest to it are retrieved and their modules
imported (`rag.chat.CorpusChat`, what the server runs; their labels, sections ("file › section" in
`where`), scores and snippets in `response_metadata["sources"]`), unless a message already holds `format_modules` references (a retriever
chain chose them) or `k=0`. With `min_score`, a question no chunk scores that for is answered "Not found
in the documents." without generating. Text content only. Translation only."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.exceptions import OutputParserException
from langchain_core.runnables import Runnable, RunnableLambda
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from rag_promptcache.engine.result import AsyncStream, fixed_stream
from rag_promptcache.rag.chat import CorpusChat
from rag_promptcache.rag.prompts import (ANSWER_DEFAULTS, REFERENCE, build_prompt, generation_options,
                                         result_stats)
from rag_promptcache.rag.retrieval import NOT_FOUND

from langchain_rag_promptcache.modules import engine_of

ROLES = {"system": "system", "human": "user", "user": "user", "ai": "assistant", "assistant": "assistant"}


def _parsed(parser: Runnable) -> Runnable:
    """`parser` over the answer; where it cannot parse an answer the token budget cut off, the error says
    that was the cause (LangChain's JSON parsers close a cut object where they can: that still parses)."""

    def parse(message: AIMessage) -> Any:
        try:
            return parser.invoke(message)
        except OutputParserException as e:
            if message.response_metadata.get("finish_reason") != "length":
                raise
            used = (message.usage_metadata or {}).get("output_tokens", "its")
            raise OutputParserException(f"the answer reached max_tokens ({used} tokens) before its JSON was "
                                        f"complete (finish_reason 'length'); raise max_tokens. The parser: {e}",
                                        llm_output=message.text) from e

    return RunnableLambda(parse)


def _turn(message: BaseMessage) -> tuple[str, str]:
    role = getattr(message, "role", None) if message.type == "chat" else message.type
    if role not in ROLES:
        raise ValueError(f"unsupported message type {message.type!r} (role {role!r}); valid: system, human, ai")
    content = message.content
    if isinstance(content, str):
        return ROLES[role], content
    texts = []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            texts.append(block["text"])
        elif not (isinstance(block, dict) and block.get("type") in ("reasoning", "thinking")):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"unsupported content block {kind!r} in a {message.type} message; ChatPromptCache takes text only")
    return ROLES[role], "".join(texts)


def _usage(result: Any) -> UsageMetadata:
    return UsageMetadata(input_tokens=result.prompt_tokens, output_tokens=result.num_generated,
                         total_tokens=result.prompt_tokens + result.num_generated,
                         input_token_details={"cache_read": result.cached_tokens})


class ChatPromptCache(BaseChatModel):
    """`ChatPromptCache(corpus=Corpus.open(dir), k=4)` (answers from the corpus: retrieves for each question)
    or `ChatPromptCache(engine=PromptCache.from_pretrained(…))` (no retrieval)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    corpus: Any = None
    engine: Any = None
    k: int = Field(default=4, ge=0)  # chunks retrieved per question with a corpus; 0: only modules the messages name
    min_score: float | None = Field(default=None, ge=-1, le=1)
    model_name: str = ""
    # `ask`'s answer defaults, one record (rag.repetition.AnswerDefaults): the length is the knob to turn
    max_tokens: int = Field(default=ANSWER_DEFAULTS.max_new_tokens, gt=0,
                            validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    temperature: float = ANSWER_DEFAULTS.temperature
    no_repeat_ngram: int = Field(default=ANSWER_DEFAULTS.no_repeat_ngram, ge=0)  # zero turns it off
    stop_repeats: bool = ANSWER_DEFAULTS.stop_repeats  # end the answer before a sentence it repeats
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] | None = None
    streaming: bool = False

    _chat: CorpusChat | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _bind(self) -> ChatPromptCache:
        self.engine = engine_of(self.corpus, self.engine)
        self.model_name = self.model_name or self.engine.model_name
        return self

    @property
    def _llm_type(self) -> str:
        return "rag-promptcache-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "max_tokens": self.max_tokens, "temperature": self.temperature}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="rag_promptcache", ls_model_name=kwargs.get("model", self.model_name), ls_model_type="chat",
                                 ls_temperature=kwargs.get("temperature", self.temperature),
                                 ls_max_tokens=kwargs.get("max_tokens", self.max_tokens))
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _args(self, messages: Sequence[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
              ) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
        if not messages:
            raise ValueError("empty prompt: no messages")
        kwargs = {k: v for k, v in kwargs.items() if k != "stream"}  # `stream=` is LangChain's, already acted on
        defaults = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                    "top_k": self.top_k, "seed": self.seed, "stop": self.stop,
                    "no_repeat_ngram": self.no_repeat_ngram, "stop_repeats": self.stop_repeats}
        options = generation_options(defaults, {**kwargs, "stop": stop})
        turns = [_turn(m) for m in messages]
        if self.corpus is None or not self.k or turns[-1][0] != "user" or any(REFERENCE.search(t) for _, t in turns):
            return build_prompt(turns, corpus=self.corpus, chat=True), [], options
        if self._chat is None:
            self._chat = CorpusChat(self.corpus)
        built = self._chat.chat_prompt(turns, k=self.k, max_new_tokens=options.get("max_new_tokens", self.max_tokens),
                                       min_score=self.min_score)
        sources = [{"module_id": h.module_id, "source": h.label, "section": h.section, "where": h.where, "score": h.score,
                    "snippet": h.snippet} for h in built.sources]
        return built.prompt, sources, options

    def _run(self, prompt: Any, options: dict[str, Any]) -> Any:
        """The engine's stream, or a fixed "not found" one (prompt None: nothing scored `min_score`)."""
        return fixed_stream(NOT_FOUND) if prompt is None else self.engine.stream(prompt, **options)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        prompt, sources, options = self._args(messages, stop, kwargs)
        result = fixed_stream(NOT_FOUND).consume() if prompt is None else self.engine.generate(prompt, **options)
        return self._chat_result(result, sources)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        prompt, sources, options = self._args(messages, stop, kwargs)
        result = fixed_stream(NOT_FOUND).consume() if prompt is None else await self.engine.agenerate(prompt, **options)
        return self._chat_result(result, sources)

    def with_structured_output(self, schema: dict[str, Any] | type[BaseModel], *, include_raw: bool = False,
                               method: str = "json_schema", **kwargs: Any) -> Runnable:
        """The answer constrained to `schema` (a pydantic class or a JSON schema dict) by the engine's
        constrained decoding, parsed into that class (or a dict). Tools are not implemented."""
        if method != "json_schema" or include_raw or kwargs:
            raise ValueError(f"with_structured_output supports method='json_schema' only, without include_raw or "
                             f"other options; got method={method!r}, include_raw={include_raw}, {sorted(kwargs)}")
        pydantic = isinstance(schema, type) and issubclass(schema, BaseModel)
        js = schema.model_json_schema() if pydantic else dict(schema)
        fmt = {"type": "json_schema", "json_schema": {"name": js.get("title", "output"), "schema": js}}
        parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        return self.bind(response_format=fmt) | _parsed(parser)

    def _chat_result(self, result: Any, sources: list[dict[str, Any]]) -> ChatResult:
        info = {**result_stats(result), "sources": sources}
        message = AIMessage(content=result.text, usage_metadata=_usage(result),
                            response_metadata={"model_name": self.model_name, **info})
        return ChatResult(generations=[ChatGeneration(message=message, generation_info=info)])

    def _last(self, result: Any, sources: list[dict[str, Any]]) -> ChatGenerationChunk:
        info = {**result_stats(result), "sources": sources}
        message = AIMessageChunk(content="", usage_metadata=_usage(result), chunk_position="last",
                                 response_metadata={"model_name": self.model_name, **info})
        return ChatGenerationChunk(message=message, generation_info=info)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        prompt, sources, options = self._args(messages, stop, kwargs)
        stream = self._run(prompt, options)
        for piece in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield self._last(stream.result, sources)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        prompt, sources, options = self._args(messages, stop, kwargs)
        stream = AsyncStream(lambda: fixed_stream(NOT_FOUND)) if prompt is None else self.engine.astream(prompt, **options)
        async for piece in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager is not None:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield self._last(stream.result, sources)
