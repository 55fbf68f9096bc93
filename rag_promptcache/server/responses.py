"""The OpenAI wire format, server to client: response, stream chunk and error bodies as pydantic models.

One set of models both builds every body the server sends and describes it in the server's OpenAPI
schema (`openapi.py`), so the schema says exactly what goes out: each model forbids fields it does not
declare, and a stream's chunks are these models too (`ChatCompletionChunk`, `CompletionChunk`, dumped
one per server-sent event). Our extra fields: `sources` (a response's and a stream's first chunk's
retrieved chunks), `usage.ttft_s`, `usage.path` (the engine's: "cached", "full", or "none" when nothing
was generated), `usage.served` (how the modules were served: "store", "deferred": a miss computed in the
request and stored after it, "waited": a miss encoded before the answer, "none") and `usage.adapter`.

Not here: request bodies (`protocol.py`), routing (`app.py`).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from rag_promptcache.engine.result import Result
from rag_promptcache.rag.chat import Source

FINISH: dict[str, Literal["stop", "length"]] = {"eos": "stop", "stop": "stop", "length": "length"}  # ours → OpenAI's
Finish = Literal["stop", "length"]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Out):
    message: str
    type: str  # invalid_request_error, rate_limit_error, server_error
    param: str | None  # the request field at fault, where one is
    code: str | None


class ErrorResponse(_Out):
    """Every error the server answers, whatever its status (and a stream's last event when it fails)."""

    error: ErrorDetail


class PromptTokensDetails(_Out):
    cached_tokens: int


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    ttft_s: float  # the server's time to the first token
    path: Literal["cached", "full", "none"]
    served: Literal["store", "deferred", "waited", "none"]  # `Result.served`
    adapter: str | None  # the tuned adapter merged into the model; null: the base model


class SourceOut(_Out):
    module_id: str
    label: str  # the document
    section: str  # the chunk's title and heading path in it; "" where it has none
    where: str  # "label › section" (the label alone without a section): what to show a user
    score: float | None  # None: the request named its modules (`module_ids`), nothing was retrieved
    snippet: str  # the start of the chunk's text


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: Finish


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    sources: list[SourceOut]


class Delta(_Out):
    role: Literal["assistant"] | None = None  # the first chunk's only
    content: str | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: Delta
    logprobs: None
    finish_reason: Finish | None


class ChatCompletionChunk(_Out):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]  # empty in the usage chunk
    sources: list[SourceOut] | None = None  # the first chunk's only
    usage: Usage | None = None  # the last chunk's, with stream_options.include_usage


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: None
    finish_reason: Finish


class Completion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_Out):
    index: int
    text: str
    logprobs: None
    finish_reason: Finish | None  # the last chunk's only


class CompletionChunk(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]  # empty in the usage chunk
    usage: Usage | None = None  # the last chunk's, with stream_options.include_usage


class Embedding(_Out):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(_Out):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(_Out):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: str  # the corpus directory's name
    object: Literal["model"]
    created: int
    owned_by: str
    root: str  # the language model's name
    max_model_len: int
    schema_name: str = Field(alias="schema")  # the PML schema /v1/completions prompts import modules from
    embedder: str
    adapter: str | None
    num_documents: int  # the corpus's size
    num_modules: int
    num_tokens: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: Literal["ok"]
    model: str  # the first corpus served
    models: list[str]  # every corpus served, by the name a request's `model` gives it
    num_batchers: int  # schedulers: one per loaded model, shared by the corpora built with it
    running: int
    waiting: int
    max_batch: int
    max_queue: int
    background_queue: int  # missed modules the background encoder has yet to store (it works while idle)


# -- builders ------------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(result: Result) -> Usage:
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.num_generated,
                 total_tokens=result.prompt_tokens + result.num_generated,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens),
                 ttft_s=round(result.ttft_s, 4), path=result.path, served=result.served, adapter=result.adapter)


def sources(found: tuple[Source, ...]) -> list[SourceOut]:
    return [SourceOut(module_id=s.module_id, label=s.label, section=s.section, where=s.where, score=s.score,
                      snippet=s.snippet) for s in found]


def embeddings_response(model: str, vectors: np.ndarray, num_tokens: int, encoding: str) -> EmbeddingList:
    """OpenAI's shape; base64 is the raw little-endian float32 bytes, as OpenAI sends it."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")  # [n, dim]
    data = [Embedding(object="embedding", index=i,
                      embedding=base64.b64encode(row.tobytes()).decode("ascii") if encoding == "base64" else row.tolist())
            for i, row in enumerate(rows)]
    return EmbeddingList(object="list", data=data, model=model,
                         usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))


def chat_response(rid: str, model: str, result: Result, found: list[SourceOut]) -> ChatCompletion:
    choice = ChatChoice(index=0, message=AssistantMessage(role="assistant", content=result.text), logprobs=None,
                        finish_reason=FINISH[result.finish_reason])
    return ChatCompletion(id=rid, object="chat.completion", created=int(time.time()), model=model, choices=[choice],
                          usage=usage(result), sources=found)


def chat_chunk(rid: str, model: str, delta: Delta | None, finish: Finish | None = None, *,
               sources: list[SourceOut] | None = None, usage: Usage | None = None) -> str:
    """One stream event's JSON; `delta` None: the usage chunk (no choices). What a chunk does not carry
    is left out (`sources`, `usage`, a delta's `role`), as OpenAI streams them; a choice's `logprobs`
    and `finish_reason` stay, null."""
    choices = [] if delta is None else [ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=finish)]
    extra = {name: value for name, value in (("sources", sources), ("usage", usage)) if value is not None}
    return ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=int(time.time()), model=model,
                               choices=choices, **extra).model_dump_json(exclude_unset=True)


def completion_chunk(rid: str, model: str, text: str | None, finish: Finish | None = None, *,
                     usage: Usage | None = None) -> str:
    """One stream event's JSON; `text` None: the usage chunk (no choices)."""
    choices = [] if text is None else [CompletionChunkChoice(index=0, text=text, logprobs=None, finish_reason=finish)]
    extra = {"usage": usage} if usage is not None else {}
    return CompletionChunk(id=rid, object="text_completion", created=int(time.time()), model=model, choices=choices,
                           **extra).model_dump_json(exclude_unset=True)


def completion_response(rid: str, model: str, result: Result) -> Completion:
    choice = CompletionChoice(index=0, text=result.text, logprobs=None, finish_reason=FINISH[result.finish_reason])
    return Completion(id=rid, object="text_completion", created=int(time.time()), model=model, choices=[choice],
                      usage=usage(result))


def error(message: str, type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict[str, object]:
    """An error body as JSON-ready data (the middlewares write it without FastAPI)."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()
