"""The OpenAI wire format, both ways: request bodies (pydantic, strict, unknown fields ignored as
OpenAI's clients expect) and response / chunk / error bodies (plain dicts).

Our extra request fields: `k`, `module_ids`, `recovery`, `ignore_eos`. Our extra response field:
`sources`, a list of {module_id, label, score} (in the response, and in the first stream chunk).
Not here: routing and generation (`app.py`).
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rag_promptcache.engine.result import Result
from rag_promptcache.rag.chat import Source

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # ours → OpenAI's
DEFAULT_MAX_TOKENS = 256


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    recovery: str | None = None
    ignore_eos: bool = False

    def sampling(self, max_tokens: int | None = None) -> dict[str, object]:
        stop = self.stop if isinstance(self.stop, list) else [self.stop] if self.stop else []
        out: dict[str, object] = {"max_new_tokens": max_tokens or self.max_tokens or DEFAULT_MAX_TOKENS,
                                  "stop": tuple(s for s in stop if s)}
        if self.temperature is not None:
            out["temperature"] = self.temperature
        if self.top_p is not None:
            out["top_p"] = self.top_p
        if self.seed is not None:
            out["seed"] = self.seed
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    k: int | None = Field(None, ge=1, le=64)
    module_ids: list[str] | None = None

    def turns(self) -> list[tuple[str, str]]:
        return [("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]


class CompletionRequest(_Generation):
    prompt: str | list[str]

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError(f"prompt: one prompt per request, got a list of {len(self.prompt)}")
        return self.prompt[0]


# -- responses -----------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(result: Result) -> dict[str, object]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.num_generated,
            "total_tokens": result.prompt_tokens + result.num_generated,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def sources(found: tuple[Source, ...]) -> list[dict[str, object]]:
    return [{"module_id": s.module_id, "label": s.label, "score": s.score} for s in found]


def chat_response(rid: str, model: str, result: Result, found: tuple[Source, ...]) -> dict[str, object]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None, "finish_reason": FINISH[result.finish_reason]}],
            "usage": usage(result), "sources": sources(found)}


def chat_chunk(rid: str, model: str, delta: dict[str, object], finish: str | None = None,
               **extra: object) -> dict[str, object]:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


def completion_response(rid: str, model: str, result: Result) -> dict[str, object]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": result.text, "logprobs": None,
                         "finish_reason": FINISH[result.finish_reason]}],
            "usage": usage(result)}


def completion_chunk(rid: str, model: str, text: str, finish: str | None = None, **extra: object) -> dict[str, object]:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra}


def error(message: str, type: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
