"""Constrained decoding on the real SmolLM2 tokenizer (no weights): a greedy loop over random logits,
masked by a GrammarState, must produce JSON that parses and validates, whatever the logits say."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("llguidance", reason="structured output needs the [structured] extra")

from rag_promptcache.engine.decoding.grammar import Grammar, GrammarState, ResponseFormat  # noqa: E402

STOP = (0, 2)  # SmolLM2's <|endoftext|> and <|im_end|>, the engine's EOS set for this model
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["author", "editor", "reader"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                    "required": ["city"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "scores", "address", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def closers(tokenizer) -> torch.Tensor:
    """Token ids that can end a value or a container. The loop adds a bonus to them that grows with
    each step, so that random logits finish a free-form string in bounded steps; which tokens the
    grammar allows is still decided by the grammar alone."""
    chars = set('"}],0123456789')
    ids = [i for tok, i in tokenizer.get_vocab().items()
           if (text := tokenizer.convert_tokens_to_string([tok])) and set(text) <= chars]
    return torch.tensor(ids + list(STOP))


def greedy(state: GrammarState, tokenizer, closers: torch.Tensor, seed: int, dtype=torch.float32,
           max_steps: int = 400) -> str:
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for step in range(max_steps):
        logits = torch.randn(len(tokenizer), generator=g)  # [V]
        logits[closers] += 0.05 * step
        logits = logits.to(dtype)
        token = int(state.mask(logits).argmax())
        state.accept(token)
        if token in STOP:
            break
        out.append(token)
        if state.is_terminated():
            break
    assert state.is_terminated(), f"not finished in {max_steps} steps: {tokenizer.decode(out)!r}"
    return tokenizer.decode(out)


@pytest.mark.parametrize("seed", range(4))
def test_json_object_output_parses_to_an_object(tokenizer, closers, seed):
    text = greedy(Grammar.json_object(tokenizer, STOP).start(), tokenizer, closers, seed)
    assert isinstance(json.loads(text), dict), text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_json_schema_output_validates(tokenizer, closers, seed, dtype):
    text = greedy(Grammar.json_schema(tokenizer, PERSON, STOP).start(), tokenizer, closers, seed, dtype)
    jsonschema.validate(json.loads(text), PERSON)


def test_without_the_grammar_the_same_loop_is_not_json(tokenizer, closers):
    # the control: the logits alone do not produce JSON, so the tests above test the mask
    g = torch.Generator().manual_seed(0)
    tokens = [int(torch.randn(len(tokenizer), generator=g).argmax()) for _ in range(20)]
    with pytest.raises(json.JSONDecodeError):
        json.loads(tokenizer.decode(tokens))


def test_stop_tokens_only_once_the_json_is_complete(tokenizer):
    state = Grammar.json_object(tokenizer, STOP).start()
    allowed = torch.isfinite(state.mask(torch.zeros(len(tokenizer))))
    assert not allowed[list(STOP)].any()
    assert tokenizer.decode(allowed.nonzero()[:, 0].tolist()).lstrip().startswith("{")
    for token in tokenizer.encode('{"a": [1, {"b": null}]}'):
        assert not state.is_terminated()
        state.accept(token)
    assert state.is_terminated()
    allowed = torch.isfinite(state.mask(torch.zeros(len(tokenizer))))
    assert allowed.nonzero()[:, 0].tolist() == list(STOP)


def test_a_json_object_nests_at_most_json_object_depth_levels(tokenizer):
    # a small model under a token limit opened object after object; the grammar closes them in time
    from rag_promptcache.engine.decoding.grammar import JSON_OBJECT_DEPTH

    state = Grammar.json_object(tokenizer, STOP).start()
    deepest = '{"a": ' * JSON_OBJECT_DEPTH + "1" + "}" * JSON_OBJECT_DEPTH
    for token in tokenizer.encode(deepest):
        state.accept(token)
    assert state.is_terminated()
    state = Grammar.json_object(tokenizer, STOP).start()
    for token in tokenizer.encode('{"a": ' * JSON_OBJECT_DEPTH):  # the deepest object's first value
        state.accept(token)
    allowed = torch.isfinite(state.mask(torch.zeros(len(tokenizer)))).nonzero()[:, 0].tolist()
    texts = {tokenizer.decode([t]) for t in allowed}
    assert not any(t.strip().startswith(("{", "[")) for t in texts)  # a level past the bound cannot open
    assert any(t.strip().startswith('"') for t in texts) and "1" in texts  # a scalar can


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_object_schema_bounds_the_nesting(depth):
    from rag_promptcache.engine.decoding.grammar import object_schema

    def nested(levels: int) -> dict:
        """An object whose containers nest `levels` deep, arrays and objects taking turns."""
        value: object = 1
        for i in range(levels - 1):
            value = [value] if i % 2 else {"a": value}
        return {"x": value, "n": None}

    schema = object_schema(depth)
    jsonschema.validate(nested(depth), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(nested(depth + 1), schema)
    with pytest.raises(ValueError, match="at least one level"):
        object_schema(0)


def test_a_forbidden_token_is_refused(tokenizer):
    state = Grammar.json_schema(tokenizer, PERSON, STOP).start()
    with pytest.raises(ValueError, match="not allowed here by the grammar: Parser Error: token \"hello\""):
        state.accept(tokenizer.encode("hello")[0])


def test_properties_come_in_the_order_the_schema_declares(tokenizer):
    # pydantic lists fields in class order; the model is asked for them in that order
    state = Grammar.json_schema(tokenizer, PERSON, STOP).start()
    for token in tokenizer.encode('{"name": "Ada", "age": 36, "role": "author", "scores": [], '
                                  '"address": {"city": "London"}, "active": true}'):
        state.accept(token)
    assert state.is_terminated()


def test_logits_wider_than_the_vocabulary_mask_the_padding(tokenizer):
    # a padded lm_head (Qwen, Phi-3): the extra columns are never text
    state = Grammar.json_object(tokenizer, STOP).start()
    logits = state.mask(torch.zeros(len(tokenizer) + 64))
    assert torch.isinf(logits[len(tokenizer):]).all()
    assert torch.isfinite(logits[: len(tokenizer)]).any()


def test_compiled_grammars_are_cached_per_schema(tokenizer):
    again = json.loads(json.dumps(PERSON))  # an equal schema, another object
    assert Grammar.json_schema(tokenizer, again, STOP) is Grammar.json_schema(tokenizer, PERSON, STOP)
    assert Grammar.json_schema(tokenizer, PERSON, STOP) is not Grammar.json_object(tokenizer, STOP)


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "foo"}, "Invalid type: foo"),
    ({"type": "object", "properties": {"a": {"$ref": "#/defs/x"}}}, "/defs/x"),
    ({"type": "object", "properties": {"x": False}, "required": ["x"]}, "unsatisfiable"),
    ({"type": "string", "pattern": "(("}, "unclosed group"),
])
def test_a_bad_schema_is_a_value_error_naming_the_problem(tokenizer, schema, message):
    with pytest.raises(ValueError, match="cannot be used for constrained decoding") as e:
        Grammar.json_schema(tokenizer, schema, STOP)
    assert message in str(e.value)


def test_response_format_from_openai_shapes():
    assert ResponseFormat.from_openai({"type": "text"}) is None
    assert ResponseFormat.from_openai({"type": "json_object"}) == ResponseFormat.json_object()
    fmt = ResponseFormat.from_openai({"type": "json_schema", "json_schema": {"name": "Person", "schema": PERSON,
                                                                             "strict": True}})
    assert (fmt.kind, fmt.name, json.loads(fmt.schema)) == ("json_schema", "Person", PERSON)


@pytest.mark.parametrize(("obj", "message"), [
    ("json", "must be an object with a 'type'"),
    ({"type": "yaml"}, r"one of \('text', 'json_object', 'json_schema'\), got 'yaml'"),
    ({"type": "json_schema"}, "needs {'json_schema'"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}, "needs {'json_schema'"),
])
def test_a_bad_response_format_is_a_value_error(obj, message):
    with pytest.raises(ValueError, match=message):
        ResponseFormat.from_openai(obj)


def test_a_schema_must_be_a_dict_and_serialisable():
    with pytest.raises(ValueError, match="is a dict"):
        ResponseFormat.json_schema([1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        ResponseFormat.json_schema({"default": object()})
    with pytest.raises(ValueError, match="kind must be one of"):
        ResponseFormat("xml")


# -- through the engine: the one decode state, alone, batched and with prompt lookup -----------------

SMALL = {  # every value bounded, so that even a random-weight model's answer ends
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "rank": {"type": "integer", "minimum": 1, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["old", "new", "big"]}, "maxItems": 3},
        "open": {"type": "boolean"},
    },
    "required": ["city", "rank", "tags", "open"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "City", "schema": SMALL, "strict": True}}
DOC = ('<schema name="g"><module name="a">Paris: {"city": "Paris", "rank": 1, "tags": ["old", "big"], '
       '"open": true}</module></schema>')
ASK = '<prompt schema="g"><a/><user>Describe the city as JSON.</user></prompt>'


@pytest.fixture(scope="module")
def engines(tokenizer):
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.store import MemoryStore
    from tests.tiny import build

    def make(lookup: int) -> PromptCache:
        pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(),
                         recovery="none", prompt_lookup=lookup)
        pc.add_schema(DOC)
        return pc

    return make(0), make(4)


def test_engine_answers_validate_alone_batched_and_with_lookup(engines):
    plain, lookup = engines
    alone = plain.generate(ASK, response_format=FORMAT, max_new_tokens=300)
    jsonschema.validate(json.loads(alone.text), SMALL)
    assert alone.finish_reason == "eos"  # ended by the grammar, not the budget
    assert lookup.generate(ASK, response_format=FORMAT, max_new_tokens=300).token_ids == alone.token_ids
    batched = plain.generate_batch([ASK, ASK, "Say something."], max_batch=3, max_new_tokens=300,
                                   response_format=FORMAT)
    assert [r.token_ids for r in batched[:2]] == [alone.token_ids] * 2
    free = plain.generate(ASK, max_new_tokens=40)  # the control: the same model unconstrained
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)


def test_engine_json_object_and_a_format_record(engines):
    plain, _ = engines
    result = plain.generate(ASK, response_format=ResponseFormat.json_object(), max_new_tokens=300,
                            no_repeat_ngram=3)  # the grammar wins where every allowed token repeats
    assert result.finish_reason == "eos", result.text
    assert isinstance(json.loads(result.text), dict)
    assert plain.generate(ASK, response_format={"type": "text"}, max_new_tokens=8).text == \
        plain.generate(ASK, max_new_tokens=8).text


def test_engine_refuses_a_bad_schema_before_queueing(engines):
    plain, _ = engines
    bad = {"type": "json_schema", "json_schema": {"name": "Bad", "schema": {"type": "foo"}}}
    with pytest.raises(ValueError, match="response_format: the JSON schema 'Bad' cannot be used"):
        plain.stream(ASK, response_format=bad)
    with plain.scheduler() as s:
        with pytest.raises(ValueError, match="Invalid type: foo"):
            s.submit(ASK, response_format=bad)
        assert s.num_waiting == 0 and s.num_running == 0
    with pytest.raises(ValueError, match="response_format type must be one of"):
        plain.generate(ASK, response_format={"type": "yaml"})



# -- an answer the budget would cut ends as valid JSON (json_close.py, GrammarState.closing) -------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3), max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(value=_json_values, indent=st.sampled_from([None, 1]), ascii=st.booleans())
def test_every_prefix_of_json_closes_into_json(value, indent, ascii):
    from rag_promptcache.engine.decoding.json_close import closing

    text = json.dumps(value, indent=indent, ensure_ascii=ascii)
    for end in range(len(text) + 1):
        suffix = closing(text[:end])
        assert suffix is not None, text[:end]
        json.loads(text[:end] + suffix)  # raises where the closing is wrong
    assert closing(text) == "" and closing(text + "}") is None


def test_the_shortest_closing_completes_what_is_open():
    from rag_promptcache.engine.decoding.json_close import closing

    assert closing('{"tools": {"toolname_json_option_key') == '":0}}'
    assert closing('{"a": [1, {"b": tr') == "ue}]}" and closing('{"a": 1,') == '"_":0}'
    assert closing('{"a": "x\\u00') == '00"}' and closing("") == "{}" and closing('{"a" 1') is None


@pytest.mark.parametrize("budget", [1, 2, 3, 5, 8, 13, 21, 34])
@pytest.mark.parametrize("seed", range(3))
def test_a_json_object_ends_as_json_whatever_the_budget(tokenizer, closers, budget, seed):
    """A budget too short for what the logits want: the answer still parses, ended in its last tokens."""
    g = torch.Generator().manual_seed(seed)
    state = Grammar.json_object(tokenizer, STOP).start()
    out: list[int] = []
    for step in range(budget):
        forced = state.closing(budget - step)
        logits = torch.randn(len(tokenizer), generator=g)
        logits[closers] -= 5.0  # the logits keep every string and container open
        token = forced if forced is not None else int(state.mask(logits).argmax())
        state.accept(token)
        out.append(token)
        if state.is_terminated():
            break
    if budget >= 2:  # "{}" is the shortest object: two tokens
        assert isinstance(json.loads(tokenizer.decode(out)), dict), tokenizer.decode(out)
        assert state.is_terminated()


def test_a_key_ends_within_json_object_key_chars(tokenizer):
    from rag_promptcache.engine.decoding.grammar import JSON_OBJECT_KEY_CHARS

    state = Grammar.json_object(tokenizer, STOP).start()
    for token in tokenizer.encode('{"' + "k" * JSON_OBJECT_KEY_CHARS):
        state.accept(token)
    allowed = torch.isfinite(state.mask(torch.zeros(len(tokenizer)))).nonzero()[:, 0].tolist()
    assert all(tokenizer.decode([t]).startswith('"') for t in allowed), [tokenizer.decode([t]) for t in allowed[:5]]


def test_the_engine_ends_a_json_answer_within_its_max_new_tokens(engines):
    """Through the one decode state, alone and batched: a random-weight model under json_object with a
    budget far too short for what it writes still answers JSON."""
    plain, _ = engines
    for budget in (6, 12, 24):
        alone = plain.generate(ASK, response_format={"type": "json_object"}, max_new_tokens=budget, temperature=1.0,
                               seed=budget)
        assert isinstance(json.loads(alone.text), dict) and alone.num_generated <= budget, alone.text
        assert alone.finish_reason == "length"  # the budget ended it, closed as JSON
    batched = plain.generate_batch([ASK, ASK], max_new_tokens=10, response_format={"type": "json_object"},
                                   temperature=1.0, seed=3)
    assert all(isinstance(json.loads(r.text), dict) for r in batched), [r.text for r in batched]
