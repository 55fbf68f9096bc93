"""The OpenAI wire format, client to server: request bodies (pydantic, strict), and what the server's
OpenAPI schema says of them (each model's `json_schema`: the fields refused unless off, listed with the
values accepted; no other field).

A request field we do not implement is refused by name (`refused`) unless it cannot change the output:
bookkeeping fields (`user`, `metadata`, `store`, ...) are accepted (of their OpenAI types) and ignored, and fields we lack
(`tools`, `logprobs`, penalties, ...) are accepted only at their "off" value or null, which is what
clients send by default. Silently ignoring them would hand a client output in a shape it did not ask
for, failing far from the cause. `response_format` is implemented: `json_object` and `json_schema`
(OpenAI's shapes, what `with_structured_output` sends) constrain decoding in the engine
(engine/decoding/grammar.py); a malformed one is refused by name here, a schema the grammar library cannot
use when the request is submitted.

Our extra request fields: `k`, `module_ids`, `min_score` (chat: no chunk scoring it, the answer is
"Not found in the documents." without generating, `usage.path` "none"), `filter` (chat: a metadata filter
applied inside retrieval, rag/filters.py), `recovery`, `ignore_eos`,
`no_repeat_ngram` and `stop_repeats` (the repetition control every answer path shares, on by default:
rag/repetition.py). Our extra response fields are `responses.py`'s.
Not here: responses (`responses.py`), routing and generation (`app.py`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic_core import PydanticCustomError

from rag_promptcache.engine.decoding.grammar import ResponseFormat
from rag_promptcache.engine.decoding.sampling import SEED_MIN, SEED_MAX
from rag_promptcache.rag.repetition import ANSWER_DEFAULTS, answer_options
from rag_promptcache.server.embeddings import MAX_INPUTS

DEFAULT_MAX_TOKENS = ANSWER_DEFAULTS.max_new_tokens  # `ask`'s answer length, where a request sets none

# Not implemented: accepted only at the value that means "off" (or null).
OFF: dict[str, tuple[object, ...]] = {
    "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},), "logprobs": (False, 0),
    "top_logprobs": (0,), "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "modalities": (["text"],), "echo": (False,), "best_of": (1,), "suffix": ("",), "audio": (), "prediction": (),
    "reasoning_effort": (), "web_search_options": (),
}


def _whole(value: object) -> object:
    # JSON Schema's integers include 2.0; strict parsing alone would refuse it
    return int(value) if isinstance(value, float) and value.is_integer() else value


def Int(**bounds: int) -> object:  # noqa: N802 - a type, as pydantic's conint
    """An integer field, 2.0 included, within `bounds` (ge, le): the bounds inside the annotation, where
    pydantic writes them into the schema as JSON Schema's minimum / maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]
# what `Recovery.parse` reads (engine/planning/recovery.py): a kind, its budget, a layer where it takes one, and
# from how many retrieved modules on it applies
RECOVERY = (r"^(none|((first_k|last|links|tail):[0-9]{1,4}|attend:[0-9]{1,4}(@[0-9]{1,3})?"
            r"|(selective|question):(0(\.[0-9]{1,4})?|1(\.0{1,4})?)(@[0-9]{1,3})?)(@k>=[0-9]{1,3})?)$")


def _off_values(schema: dict[str, object]) -> None:
    """A generation request's schema: the OFF fields with their "off" values (or null), and no other field
    than those declared."""
    props = schema.setdefault("properties", {})
    for name, values in OFF.items():
        props.setdefault(name, {"anyOf": [*({"const": v} for v in values), {"type": "null"}]})
    schema["additionalProperties"] = False


def _no_extras(schema: dict[str, object]) -> None:
    schema["additionalProperties"] = False


def _is_off(value: object, off: tuple[object, ...]) -> bool:
    # as JSON Schema's const compares: false is not 0, 0.0 is 0
    return any(isinstance(value, bool) == isinstance(v, bool) and value == v for v in off)


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


class JsonSchemaSpec(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = ""
    schema_: dict[str, object] = Field(alias="schema")
    strict: bool | None = None  # honoured either way: the output always matches the schema
    description: str | None = None


class _Format(_Body):
    model_config = ConfigDict(extra="forbid", strict=True)

    def openai(self) -> dict[str, object]:
        return self.model_dump(by_alias=True, exclude_none=True)


class TextFormat(_Format):
    type: Literal["text"]


class JsonObjectFormat(_Format):
    type: Literal["json_object"]


class JsonSchemaFormat(_Format):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


# OpenAI's `response_format` (engine/decoding/grammar.py `ResponseFormat.from_openai` reads it)
ResponseFormatBody = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


def surrogate_at(value: object, path: tuple[str, ...] = ()) -> str | None:
    """Where in a parsed JSON body a string holds an unpaired UTF-16 surrogate ("\\ud800" is valid JSON
    but no Unicode text: no tokenizer takes it), as a dotted path; None where none does."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return ".".join(path) or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            if (where := surrogate_at(key, path) or surrogate_at(item, (*path, str(key)))) is not None:
                return where
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (where := surrogate_at(item, (*path, str(i)))) is not None:
                return where
    return None


class _Request(_Body):
    """What every request body takes. Accepted and ignored: fields that label or route a request and
    do not change what is generated (OpenAI's types, checked)."""

    # extras are kept so that `refused` can name them; see the module docstring
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_no_extras)

    model: str
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: object) -> object:
        if (where := surrogate_at(data)) is not None:
            raise PydanticCustomError("unpaired_surrogate", "{field}: the text holds an unpaired UTF-16 surrogate, "
                                      "which is not Unicode text; send text that encodes as UTF-8", {"field": where})
        return data

    def unknown(self) -> tuple[str, str] | None:
        """(field, why) for the first field this body does not declare (and is not null)."""
        for name, value in (self.model_extra or {}).items():
            if value is not None and name not in OFF:
                known = ", ".join(sorted(type(self).model_fields))
                return name, f"unknown field {name!r}; this server accepts: {known}"
        return None


class GenerationRequest(_Request):
    """What a chat and a completion request share: the sampling fields, `refused` and `include_usage`
    (`app.py` checks and submits either through these)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_off_values)

    max_tokens: Int(ge=1) | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: Int(ge=SEED_MIN, le=SEED_MAX) | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # parsed as any number so that `refused` can say why only 1 is served
    n: Annotated[Int() | None, WithJsonSchema({"anyOf": [{"const": 1}, {"type": "null"}]})] = 1
    recovery: str | None = Field(None, pattern=RECOVERY)
    ignore_eos: bool = False
    response_format: ResponseFormatBody | None = None  # its schema is checked in `refused`
    # the repetition control `ask`, `chat` and the adapters apply (rag/repetition.py): None keeps its default
    no_repeat_ngram: Annotated[Int(ge=0) | None, WithJsonSchema(
        {"anyOf": [{"const": 0}, {"type": "integer", "minimum": 2}, {"type": "null"}]})] = None
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
            out["response_format"] = self.response_format.openai()
        if self.no_repeat_ngram is not None:
            out["no_repeat_ngram"] = self.no_repeat_ngram
        if self.stop_repeats is not None:
            out["stop_repeats"] = self.stop_repeats
        elif self.ignore_eos:  # exactly max_tokens tokens (benchmarks): no sentence ends the answer early
            out["stop_repeats"] = False
        return answer_options(out)

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for the first field this server cannot honour, or None."""
        if self.n not in (None, 1):
            return "n", f"n={self.n}: this server returns one choice per request (n must be 1)"
        if self.response_format is not None:
            try:
                ResponseFormat.from_openai(self.response_format.openai())
            except ValueError as e:
                return "response_format", str(e)
        for name, value in (self.model_extra or {}).items():
            if name in OFF and value is not None and not _is_off(value, OFF[name]):
                off = " or ".join(repr(v) for v in OFF[name]) or "null"
                return name, f"{name}={value!r} is not supported by this server (send {off} or omit it)"
        return self.unknown()

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(GenerationRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Int(ge=1) | None = None
    k: Int(ge=1, le=64) | None = None
    module_ids: list[str] | None = None
    min_score: float | None = Field(None, ge=-1, le=1)
    filter: dict[str, object] | None = Field(None, description=(
        "Only chunks whose metadata matches, chosen inside the search: LangChain's vector-store filter, such as "
        '{"source": "guide/fs.md"}, {"year": {"$gte": 2020}}, {"section": {"$glob": "Config*"}} or {"$or": [...]}. '
        "Keys: source, path, type, title, modified, section and the documents' own fields; operators: $eq, $ne, "
        "$gt, $gte, $lt, $lte, $in, $nin, $prefix, $glob, $and, $or. An unknown key or operator is a 400 naming "
        "the valid ones; no chunk matching answers \"Not found in the documents.\" without generating."))

    def turns(self) -> list[tuple[str, str]]:
        return [("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]


TEXT = {"type": "string", "pattern": r"\S"}  # something to answer, or to embed


class CompletionRequest(GenerationRequest):
    prompt: Annotated[str | list[str], WithJsonSchema(
        {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 1}]})]

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError(f"prompt: one prompt per request, got a list of {len(self.prompt)}")
        return self.prompt[0]


class EmbeddingRequest(_Request):
    # token-id inputs parse, so that they are refused by name rather than as a type error
    input: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(
        {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1, "maxItems": MAX_INPUTS}]})]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int(ge=1) | None = None

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
        return self.unknown()
