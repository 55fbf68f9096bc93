"""Constrained decoding for structured output: a JSON object, or JSON matching a schema.

`ResponseFormat` is what a caller asks for (OpenAI's `response_format` shapes parse into it).
`Grammar.compile(tokenizer, format, stop_ids)` turns it into a grammar for one tokenizer (cached), and
`grammar.start()` gives one request its `GrammarState`, which the one decode state holds
(engine/decoding/state.py): before each sampling step `mask(logits)` sets every token the grammar forbids to
-inf, after it `accept(token)` advances. The stop tokens are allowed only once the JSON is complete,
and `is_terminated()` says the answer is over.

The grammar work is llguidance's (an Earley parser over the tokenizer's byte trie, each mask computed
when asked: no per-schema precompile). Its own torch helper for applying a mask is `torch.compile`d,
which on CPU builds a C++ kernel per shape, so the bitmask is unpacked here with numpy instead.
Why llguidance over xgrammar and outlines-core: docs/concepts.md, Structured output.

No rollback: prompt lookup drafts are checked token by token through the one decode state, which
advances the grammar only past kept tokens (engine/decoding/state.py). llguidance has `rollback(n)` should a
path ever need it.

Out of scope: tool calls / function calling (the server refuses `tools` by name), user-written
regex or Lark grammars (llguidance has them; nothing asks for them yet), and masks computed on a GPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch

from rag_promptcache.engine.decoding.json_close import closing

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from transformers import PreTrainedTokenizerBase

KINDS = ("json_object", "json_schema")
# How deep the containers of a `json_object` answer may nest, the object itself counted (OpenAI's
# structured outputs allow as many levels). Unbounded, a small model can open object after object
# until the token budget cuts the answer off, and no closing brace ever comes.
JSON_OBJECT_DEPTH = 5
_SCALARS = ["string", "number", "boolean", "null"]
# Whitespace between JSON tokens, bounded: llguidance's default allows any amount, and a small model
# that likes "\n" after "{" can then spend its whole token budget on indentation.
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
INSTALL_HINT = "structured output needs llguidance: pip install 'rag-promptcache[structured]'"
# A key this long is not a name any more (a small model can spend its whole budget inside one). OpenAI's
# json_object mode bounds none; the constrained `json_object` here allows 1 to this many characters.
JSON_OBJECT_KEY_CHARS = 48
# Closing before the budget runs out (`GrammarState.closing`): looked at in the last CLOSE_WITHIN tokens,
# taken when the shortest closing needs all but CLOSE_MARGIN of those left.
CLOSE_WITHIN = 24
CLOSE_MARGIN = 3


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """What the answer must be. `schema` is the JSON schema as JSON text, so that the record is
    hashable (compiled grammars are cached by it). Key order is kept: properties are generated in the
    order the schema declares them (a pydantic model's field order)."""

    kind: str
    schema: str = ""  # empty for json_object: any object, its nesting bounded (`object_schema`)
    name: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"response format kind must be one of {KINDS}, got {self.kind!r}")
        if not self.schema:
            object.__setattr__(self, "schema", json.dumps(object_schema(JSON_OBJECT_DEPTH)))

    @classmethod
    def json_object(cls) -> ResponseFormat:
        """Any JSON object (OpenAI's `{"type": "json_object"}`)."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: dict, name: str = "") -> ResponseFormat:
        """JSON that validates against `schema` (a dict, as `model_json_schema()` returns)."""
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is a dict (a JSON object), got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"the JSON schema {name!r} is not JSON-serialisable: {e}") from e
        return cls("json_schema", text, name)

    @classmethod
    def from_openai(cls, obj: object) -> ResponseFormat | None:
        """OpenAI's `response_format` → a format, or None for `{"type": "text"}` (no constraint).
        Shapes: {"type": "json_object"}; {"type": "json_schema", "json_schema": {"name", "schema",
        "strict"?, "description"?}}. Anything else raises a ValueError saying what is valid."""
        if not isinstance(obj, dict) or "type" not in obj:
            raise ValueError(f"response_format must be an object with a 'type', got {obj!r}")
        kind = obj["type"]
        if kind == "text":
            return None
        if kind == "json_object":
            return cls.json_object()
        if kind != "json_schema":
            raise ValueError(f"response_format type must be one of ('text', 'json_object', 'json_schema'), got {kind!r}")
        spec = obj.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}, "
                             f"got {spec!r}")
        # `strict` is honoured either way: the output always matches the schema.
        return cls.json_schema(spec["schema"], str(spec.get("name", "")))


def object_schema(depth: int) -> dict:
    """A JSON schema for any JSON object whose containers nest at most `depth` deep (the object itself
    is one). `$defs` level d is a value holding containers at most d deep: a scalar (level 0), or an
    array or an object of level d - 1's values; the object's values are level depth - 1's."""
    if depth < 1:
        raise ValueError(f"a JSON object nests at least one level deep, got depth {depth}")
    defs: dict[str, dict] = {"level0": {"type": _SCALARS}}
    for d in range(1, depth):
        inner = {"$ref": f"#/$defs/level{d - 1}"}
        defs[f"level{d}"] = {"anyOf": [{"type": _SCALARS}, {"type": "array", "items": inner}, _object(inner)]}
    return {**_object({"$ref": f"#/$defs/level{depth - 1}"}), "$defs": defs}


def _object(values: dict) -> dict:
    """An object of `values` whose keys are 1 to JSON_OBJECT_KEY_CHARS characters (no line breaks)."""
    return {"type": "object", "patternProperties": {f"^.{{1,{JSON_OBJECT_KEY_CHARS}}}$": values},
            "additionalProperties": False}


class Grammar:
    """A format compiled for one tokenizer and its stop tokens; `start()` is cheap (a copy)."""

    __slots__ = ("format", "matcher", "tokenizer")

    def __init__(self, format: ResponseFormat, matcher: LLMatcher, tokenizer: LLTokenizer) -> None:
        self.format = format
        self.matcher = matcher  # an llguidance LLMatcher at the start state, copied per request
        self.tokenizer = tokenizer  # llguidance's view of the tokenizer: token bytes, and text to tokens

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size  # the tokenizer's; the model's logits may be wider (padding)

    @staticmethod
    def compile(tokenizer: PreTrainedTokenizerBase, format: ResponseFormat,
                stop_ids: Sequence[int] = ()) -> Grammar:
        """Compile (or fetch the cached) grammar. `stop_ids`: the tokens that end an answer (the
        engine's EOS set); default the tokenizer's `eos_token_id`. A schema llguidance cannot satisfy
        or does not understand raises a ValueError with its message."""
        stop = tuple(sorted(set(stop_ids))) or (tokenizer.eos_token_id,)
        if None in stop:
            raise ValueError("the tokenizer has no eos_token_id; pass stop_ids (the tokens that end an answer)")
        return _compiled(_ll_tokenizer(tokenizer, stop), format)

    @classmethod
    def json_object(cls, tokenizer: PreTrainedTokenizerBase, stop_ids: Sequence[int] = ()) -> Grammar:
        return cls.compile(tokenizer, ResponseFormat.json_object(), stop_ids)

    @classmethod
    def json_schema(cls, tokenizer: PreTrainedTokenizerBase, schema: dict,
                    stop_ids: Sequence[int] = ()) -> Grammar:
        return cls.compile(tokenizer, ResponseFormat.json_schema(schema), stop_ids)

    def start(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self.tokenizer)


class GrammarState:
    """One request's place in its grammar, and the JSON text so far. Not thread-safe; one decode loop owns it."""

    __slots__ = ("matcher", "bitmask", "tokenizer", "text")

    def __init__(self, matcher: LLMatcher, tokenizer: LLTokenizer) -> None:
        self.matcher = matcher
        self.tokenizer = tokenizer
        # bit t % 32 of word t // 32: token t allowed
        self.bitmask = torch.empty(1, (tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        self.text = bytearray()  # the answer's bytes so far

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [V] or [1, V] → a copy with the tokens the grammar forbids set to -inf. A copy: the
        model's logits are inference tensors, which cannot be written outside inference mode."""
        words = self.bitmask[0]
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())
        assert not self.matcher.is_error(), f"{self.matcher.get_error()=}"
        return apply_bitmask(logits.view(1, -1), self.bitmask).view(logits.shape)

    def accept(self, token_id: int) -> None:
        """Advance past `token_id` (which `mask` allowed). A token the grammar forbids raises."""
        if not self.matcher.consume_token(int(token_id)):
            raise ValueError(f"token {token_id} is not allowed here by the grammar: {first_error(self.matcher)}")
        self.text += self.tokenizer.decode_bytes([int(token_id)])

    def closing(self, tokens_left: int) -> int | None:
        """The token to take now so that the JSON ends within `tokens_left` tokens (this one counted): the
        first of the shortest way to end it (json_close.py), once that needs all of them but `CLOSE_MARGIN`
        (what one freely chosen token may add to it); None while there is room, where the text is complete,
        or where the grammar does not allow that token (a schema that wants more than well-formed JSON)."""
        if tokens_left > CLOSE_WITHIN or self.matcher.is_stopped():
            return None
        suffix = closing(self.text.decode("utf-8", errors="replace"))
        if not suffix:
            return None
        ids = self.tokenizer.tokenize_str(suffix)
        if not ids or tokens_left > len(ids) + CLOSE_MARGIN or self.matcher.validate_tokens(ids[:1]) != 1:
            return None
        return ids[0]

    def is_terminated(self) -> bool:
        """The output is complete (a stop token was accepted, or nothing but one could follow)."""
        return bool(self.matcher.is_stopped())


def first_error(matcher: LLMatcher) -> str:
    """llguidance's error text with its parser-state dump left out."""
    lines = matcher.get_error().splitlines()
    return next((line.removeprefix("Error: ") for line in lines if line.startswith("Error: ")), lines[0] if lines else "")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits: [n, V] any float dtype and device; bitmask: [n, W] int32 on CPU, little-endian bits →
    masked logits [n, V]. Columns past the tokenizer's vocabulary (a padded lm_head) are never text."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")  # [n, 32 W]
    allowed = np.zeros(logits.shape, dtype=bool)
    vocab = min(logits.shape[-1], bits.shape[-1])
    allowed[:, :vocab] = bits[:, :vocab]
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        # numpy, single-threaded: a 2-thread torch masked_fill of one row stalls when the cores are
        # busy (the other thread is descheduled), and one row is too small to gain from threads
        return torch.from_numpy(np.where(allowed, logits.numpy(), np.float32(-np.inf)))
    return logits.masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return llguidance


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: PreTrainedTokenizerBase, stop: tuple[int, ...]) -> LLTokenizer:
    # it walks every token's bytes (seconds for a large vocabulary): once per tokenizer and stop set
    return _llguidance().hf.from_tokenizer(tokenizer, eos_token=list(stop))


@lru_cache(maxsize=64)
def _compiled(ll_tokenizer: LLTokenizer, format: ResponseFormat) -> Grammar:
    llg = _llguidance()
    text = llg.LLMatcher.grammar_from_json_schema(json.loads(format.schema), defaults={"whitespace_pattern": WHITESPACE})
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, ll_tokenizer)
    if is_error:
        what = f"JSON schema {format.name!r}" if format.name else "JSON schema"
        raise ValueError(f"response_format: the {what} cannot be used for constrained decoding: {messages[0]}")
    matcher = llg.LLMatcher(ll_tokenizer, text, log_level=0)
    assert not matcher.is_error(), f"{matcher.get_error()=}"
    return Grammar(format, matcher, ll_tokenizer)
