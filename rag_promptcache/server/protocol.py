"""The OpenAI wire format, both ways: request bodies (pydantic, strict) and response / chunk / error
bodies (plain dicts).

A request field we do not implement is refused by name (`refused`) unless it cannot change the output:
bookkeeping fields (`user`, `metadata`, `store`, ...) are accepted and ignored, and fields we lack
(`tools`, `logprobs`, penalties, ...) are accepted only at their "off" value or null, which is what
clients send by default. Silently ignoring them would hand a client output in a shape it did not ask
for, failing far from the cause. `response_format` is implemented: `json_object` and `json_schema`
(OpenAI's shapes, what `with_structured_output` sends) constrain decoding in the engine
(engine/decoding/grammar.py); a malformed one is refused by name here, a schema the grammar library cannot
use when the request is submitted.

Our extra request fields: `k`, `module_ids`, `min_score` (chat: no chunk scoring it, the answer is
"Not found in the documents." without generating, `usage.path` "none"), `recovery`, `ignore_eos`,
`no_repeat_ngram` and `stop_repeats` (the repetition control every answer path shares, on by default:
rag/repetition.py). Our extra response fields:
`sources`, a list of {module_id, label, score, snippet} (in the response, and in the first stream
chunk), and `usage.ttft_s` (the server's time to the first token).
Not here: routing and generation (`app.py`).
"""

from __future__ import annotations

import time
import uuid
import base64
from collections.abc import Callable
from typing import Literal

import numpy as np

from pydantic import BaseModel, ConfigDict, Field

from rag_promptcache.engine.decoding.grammar import ResponseFormat
from rag_promptcache.engine.result import Result
from rag_promptcache.rag.chat import Source
from rag_promptcache.rag.repetition import answer_options

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}  # ours → OpenAI's
DEFAULT_MAX_TOKENS = 256
SNIPPET_CHARS = 240

# Accepted and ignored: they label or route a request, they do not change what is generated.
NEUTRAL = frozenset({"user", "metadata", "store", "parallel_tool_calls", "service_tier", "prompt_cache_key",
                     "safety_identifier"})
# Not implemented: accepted only at the value that means "off" (or null).
OFF: dict[str, tuple[object, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "logprobs": (False, 0),
    "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "modalities": (["text"],), "echo": (False,), "best_of": (1,), "suffix": ("",), "audio": (), "prediction": (),
    "reasoning_effort": (), "web_search_options": (),
}


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


class GenerationRequest(_Body):
    """What a chat and a completion request share: the sampling fields, `refused` and `include_usage`
    (`app.py` checks and submits either through these)."""

    # extras are kept so that `refused` can name them; see the module docstring
    model_config = ConfigDict(extra="allow", strict=True)

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
    response_format: dict[str, object] | None = None  # checked in `refused`, parsed by Sampling
    # the repetition control `ask`, `chat` and the adapters apply (rag/repetition.py): None keeps its default
    no_repeat_ngram: int | None = Field(None, ge=0)
    stop_repeats: bool | None = None

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
        if self.response_format is not None:
            out["response_format"] = self.response_format
        if self.no_repeat_ngram is not None:
            out["no_repeat_ngram"] = self.no_repeat_ngram
        if self.stop_repeats is not None:
            out["stop_repeats"] = self.stop_repeats
        elif self.ignore_eos:  # exactly max_tokens tokens (benchmarks): no sentence ends the answer early
            out["stop_repeats"] = False
        return answer_options(out)

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for the first field this server cannot honour, or None."""
        extra = self.model_extra or {}
        if self.n not in (None, 1):
            return "n", f"n={self.n}: this server returns one choice per request (n must be 1)"
        if self.response_format is not None:
            try:
                ResponseFormat.from_openai(self.response_format)
            except ValueError as e:
                return "response_format", str(e)
        for name, value in extra.items():
            if value is None or name in NEUTRAL:
                continue
            if name in OFF:
                if value not in OFF[name]:
                    off = " or ".join(repr(v) for v in OFF[name]) or "null"
                    return name, f"{name}={value!r} is not supported by this server (send {off} or omit it)"
                continue
            known = sorted({*type(self).model_fields, *NEUTRAL})
            return name, f"unknown field {name!r}; this server accepts: {', '.join(known)}"
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    k: int | None = Field(None, ge=1, le=64)
    module_ids: list[str] | None = None
    min_score: float | None = Field(None, ge=-1, le=1)

    def turns(self) -> list[tuple[str, str]]:
        return [("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]


class CompletionRequest(GenerationRequest):
    prompt: str | list[str]

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError(f"prompt: one prompt per request, got a list of {len(self.prompt)}")
        return self.prompt[0]


class EmbeddingRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    # token-id inputs parse, so that they are refused by name rather than as a type error
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    def texts(self) -> list[str]:
        """The inputs as a list of non-empty strings; ValueError for token ids or empty text."""
        items = [self.input] if isinstance(self.input, str) else list(self.input)
        if not items:
            raise ValueError("input is empty: send a string or a list of strings")
        if not all(isinstance(x, str) for x in items):
            raise ValueError("input: token-id inputs are not supported (this server has its own embedder's "
                             "tokenizer); send text, a string or a list of strings")
        if empty := [i for i, x in enumerate(items) if not x.strip()]:
            raise ValueError(f"input: item(s) {empty} are empty strings")
        return items  # type: ignore[return-value]

    def refused(self) -> tuple[str, str] | None:
        for name, value in (self.model_extra or {}).items():
            if value is not None and name not in NEUTRAL:
                known = sorted({*type(self).model_fields, *NEUTRAL})
                return name, f"unknown field {name!r}; this server accepts: {', '.join(known)}"
        return None


# -- responses -----------------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(result: Result) -> dict[str, object]:
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.num_generated,
            "total_tokens": result.prompt_tokens + result.num_generated,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens}, "ttft_s": round(result.ttft_s, 4),
            "path": result.path, "adapter": result.adapter}


def sources(found: tuple[Source, ...], text_of: Callable[[str], str]) -> list[dict[str, object]]:
    """`text_of(module_id)` gives the chunk's text; its start becomes the source's snippet."""
    out = []
    for s in found:
        text = " ".join(text_of(s.module_id).split())
        snippet = text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS].rsplit(" ", 1)[0] + " …"
        out.append({"module_id": s.module_id, "label": s.label, "score": s.score, "snippet": snippet})
    return out


def embeddings_response(model: str, vectors: np.ndarray, num_tokens: int, encoding: str) -> dict[str, object]:
    """OpenAI's shape; base64 is the raw little-endian float32 bytes, as OpenAI sends it."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")  # [n, dim]
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.tobytes()).decode("ascii") if encoding == "base64" else row.tolist()}
            for i, row in enumerate(rows)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def chat_response(rid: str, model: str, result: Result, found: list[dict[str, object]]) -> dict[str, object]:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                         "logprobs": None, "finish_reason": FINISH[result.finish_reason]}],
            "usage": usage(result), "sources": found}


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
