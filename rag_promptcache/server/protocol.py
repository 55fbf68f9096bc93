"""The OpenAI wire format, client to server: request bodies (pydantic, strict), and what the server's
OpenAPI schema says of them (each model's `json_schema`: the fields refused unless off, listed with the
values accepted; no other field).

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
rag/repetition.py). Our extra response fields are `responses.py`'s.
Not here: responses (`responses.py`), routing and generation (`app.py`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from rag_promptcache.engine.decoding.grammar import ResponseFormat
from rag_promptcache.rag.repetition import answer_options
from rag_promptcache.server.embeddings import MAX_INPUTS

DEFAULT_MAX_TOKENS = 256

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


def _accepted_extras(schema: dict[str, object]) -> None:
    """The schema of a body whose extra fields `refused` names: NEUTRAL fields take anything, OFF fields
    only their "off" values (or null), and nothing else is accepted."""
    props = schema.setdefault("properties", {})
    for name in sorted(NEUTRAL):
        props[name] = {}
    for name, values in OFF.items():
        if name in props:
            continue
        props[name] = {"anyOf": [*({"const": v} for v in values), {"type": "null"}]}
    schema["additionalProperties"] = False


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
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_accepted_extras)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # parsed as any number so that `refused` can say why only 1 is served
    n: Annotated[int | None, WithJsonSchema({"anyOf": [{"const": 1}, {"type": "null"}]})] = 1
    recovery: str | None = None
    ignore_eos: bool = False
    response_format: dict[str, object] | None = None  # checked in `refused`, parsed by Sampling
    # the repetition control `ask`, `chat` and the adapters apply (rag/repetition.py): None keeps its default
    no_repeat_ngram: Annotated[int | None, WithJsonSchema(
        {"anyOf": [{"const": 0}, {"type": "integer", "minimum": 2}, {"type": "null"}]})] = Field(None, ge=0)
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
    prompt: Annotated[str | list[str], WithJsonSchema(
        {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}]})]

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError(f"prompt: one prompt per request, got a list of {len(self.prompt)}")
        return self.prompt[0]


def _refused_extras(schema: dict[str, object]) -> None:
    for name in sorted(NEUTRAL):
        schema.setdefault("properties", {})[name] = {}
    schema["additionalProperties"] = False


TEXT = {"type": "string", "pattern": r"\S"}  # an input with something to embed


class EmbeddingRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_refused_extras)

    model: str
    # token-id inputs parse, so that they are refused by name rather than as a type error
    input: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(
        {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1, "maxItems": MAX_INPUTS}]})]
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
