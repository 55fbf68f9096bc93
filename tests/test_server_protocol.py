"""The server's wire rules without a model: which request fields are refused by name, the embeddings
request and its base64 layout, the API-key middleware, and the port check. Fast: no SmolLM2, no
server process (tests/test_server*.py and tests/test_page.py run the real thing)."""

from __future__ import annotations

import base64
import json
import socket
import struct

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from rag_promptcache.engine.decoding.sampling import Sampling
from rag_promptcache.server import protocol as p
from rag_promptcache.server import responses
from rag_promptcache.server.auth import RequireKey
from rag_promptcache.server.lifecycle import bind

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("extra", [
    {}, {"user": "u", "metadata": {"k": "v"}, "store": True, "parallel_tool_calls": True},
    {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "logprobs": False, "frequency_penalty": 0.0},
    {"response_format": None, "tools": None, "logit_bias": None, "top_logprobs": None, "anything_null": None},
    # implemented by constrained decoding (engine/decoding/grammar.py)
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}},
])
def test_fields_that_cannot_change_the_output_are_accepted(extra):
    assert p.ChatRequest.model_validate({**CHAT, **extra}).refused() is None


@pytest.mark.parametrize(("extra", "field", "says"), [
    ({"tools": [{"type": "function"}]}, "tools", "send [] or omit it"),
    ({"tool_choice": "required"}, "tool_choice", "not supported"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"presence_penalty": 1.0}, "presence_penalty", "send 0"),
    ({"audio": {"voice": "x"}}, "audio", "send null"),
    ({"n": 2}, "n", "n must be 1"),
    ({"top_k": 5}, "top_k", "unknown field 'top_k'; this server accepts: "),
])
def test_fields_we_do_not_implement_are_refused_by_name(extra, field, says):
    refused = p.ChatRequest.model_validate({**CHAT, **extra}).refused()
    assert refused is not None and refused[0] == field and says in refused[1], refused


@pytest.mark.parametrize(("bad", "where"), [
    ({"type": "yaml"}, "response_format"),
    ({"json_schema": {"schema": {}}}, "response_format"),
    ({"type": "json_schema"}, "response_format.json_schema.json_schema"),
    ({"type": "json_schema", "json_schema": {}}, "response_format.json_schema.json_schema.schema"),
    ({"type": "json_object", "strict": True}, "response_format.json_object.strict"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.json_schema.strict"),
])
def test_a_malformed_response_format_is_refused_where_it_is_wrong(bad, where):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as e:  # app.py answers 400 naming `where`
        p.ChatRequest.model_validate({**CHAT, "response_format": bad})
    assert ".".join(map(str, e.value.errors()[0]["loc"])) == where, e.value.errors()


def test_response_format_reaches_the_sampling_options():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    options = p.ChatRequest.model_validate({**CHAT, "response_format": fmt}).sampling()
    assert Sampling(**options).response_format.name == "x"
    assert "response_format" not in p.ChatRequest.model_validate(CHAT).sampling()


def test_the_server_answers_with_the_repetition_control_of_ask_and_chat():
    from rag_promptcache.rag.repetition import DEFAULT_NO_REPEAT_NGRAM, repeated_sentence

    plain = p.ChatRequest.model_validate(CHAT).sampling()
    assert plain["no_repeat_ngram"] == DEFAULT_NO_REPEAT_NGRAM and plain["stop_when"] is repeated_sentence
    off = p.ChatRequest.model_validate({**CHAT, "no_repeat_ngram": 0, "stop_repeats": False}).sampling()
    assert off["no_repeat_ngram"] == 0 and "stop_when" not in off
    # exactly max_tokens tokens: no repeated sentence ends it early
    assert "stop_when" not in p.ChatRequest.model_validate({**CHAT, "ignore_eos": True}).sampling()
    # a JSON answer ends by its grammar: a cut at a repeated sentence would not parse; the n-gram ban stays
    json_mode = p.ChatRequest.model_validate({**CHAT, "response_format": {"type": "json_object"}}).sampling()
    assert "stop_when" not in json_mode and json_mode["no_repeat_ngram"] == DEFAULT_NO_REPEAT_NGRAM
    text = p.ChatRequest.model_validate({**CHAT, "response_format": {"type": "text"}}).sampling()
    assert text["stop_when"] is repeated_sentence
    assert Sampling(**plain).no_repeat_ngram == DEFAULT_NO_REPEAT_NGRAM
    # bad values: negative is a validation error (422), 1 a ValueError naming the field (app.py: 400)
    with pytest.raises(ValueError):
        p.ChatRequest.model_validate({**CHAT, "no_repeat_ngram": -1})
    with pytest.raises(ValueError, match="no_repeat_ngram must be 0"):
        Sampling(**p.ChatRequest.model_validate({**CHAT, "no_repeat_ngram": 1}).sampling())


def test_completion_only_fields_are_refused_too():
    body = {"model": "m", "prompt": "hi"}
    assert p.CompletionRequest.model_validate({**body, "echo": False, "best_of": 1}).refused() is None
    assert p.CompletionRequest.model_validate({**body, "echo": True}).refused()[0] == "echo"
    assert p.CompletionRequest.model_validate({**body, "suffix": "x"}).refused()[0] == "suffix"


def test_embedding_inputs_and_the_base64_layout():
    assert p.EmbeddingRequest.model_validate({"model": "m", "input": "a"}).texts() == ["a"]
    for bad, says in (([1, 2], "token-id"), ([[1], [2]], "token-id"), ([], "empty"), (["a", ""], "[1]")):
        with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
            p.EmbeddingRequest.model_validate({"model": "m", "input": bad}).texts()
    assert p.EmbeddingRequest.model_validate({"model": "m", "input": "a", "user": "u"}).refused() is None
    assert p.EmbeddingRequest.model_validate({"model": "m", "input": "a", "truncate": "END"}).refused()[0] == "truncate"

    vectors = np.array([[0.5, -1.25, 3.0], [1e-3, 0.0, -7.5]], dtype=np.float32)
    out = responses.embeddings_response("m", vectors, 7, "base64").model_dump()
    assert out["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    # OpenAI's base64: the raw little-endian float32 bytes of each row
    assert base64.b64decode(out["data"][1]["embedding"]) == struct.pack("<3f", *vectors[1].tolist())
    floats = responses.embeddings_response("m", vectors, 7, "float").model_dump()["data"]
    assert [d["index"] for d in floats] == [0, 1] and floats[0]["embedding"] == [0.5, -1.25, 3.0]


def test_the_key_guards_every_path_but_health_and_the_page():
    async def ok(_):
        return PlainTextResponse("ok")

    app = RequireKey(Starlette(routes=[Route(path, ok) for path in ("/", "/health", "/v1/models")]), key="s3cret")
    http = TestClient(app)
    assert http.get("/health").text == "ok" and http.get("/").text == "ok"
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}, {"Authorization": "Bearer s3cret "}):
        r = http.get("/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
    assert http.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).text == "ok"
    with pytest.raises(ValueError, match="empty"):
        RequireKey(app, key="")


def test_a_port_in_use_is_one_value_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: the port is in use"):
            bind("127.0.0.1", port)
    bind("127.0.0.1", port).close()  # free again


def test_the_docs_say_the_server_applies_the_repetition_control_and_the_engine_does_not():
    """One truth (docs/limits.md and docs/server.md against the code): the server's requests get the
    repetition control by default (the test above; tests/test_server_fuzz.py over HTTP), the engine's
    own `generate` plain sampling."""
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    limits = " ".join((docs / "limits.md").read_text().split())
    assert "The server applies both by default" in limits
    assert "`PromptCache.generate`, the engine itself, applies neither unless asked" in limits
    assert "on unless a request sends `0` / `false`" in " ".join((docs / "server.md").read_text().split())
    plain = Sampling()
    assert plain.no_repeat_ngram == 0 and plain.stop_when is None
    served = Sampling(**p.ChatRequest.model_validate(CHAT).sampling())
    assert served.no_repeat_ngram > 0 and served.stop_when is not None


def test_stream_chunks_carry_only_what_they_have_and_match_their_models():
    """A chunk leaves out what it does not carry (OpenAI's streams do), and what it sends is its model's."""
    first = json.loads(responses.chat_chunk("c1", "m", responses.Delta(role="assistant", content=""), sources=[]))
    assert first["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None} and first["sources"] == [] and "usage" not in first
    piece = json.loads(responses.chat_chunk("c1", "m", responses.Delta(content="Hi")))
    assert piece["choices"][0]["delta"] == {"content": "Hi"} and "sources" not in piece
    last = json.loads(responses.chat_chunk("c1", "m", responses.Delta(), "length"))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    text = json.loads(responses.completion_chunk("c2", "m", "x"))
    assert text["choices"] == [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]
    for chunk, model in ((first, responses.ChatCompletionChunk), (piece, responses.ChatCompletionChunk),
                         (last, responses.ChatCompletionChunk), (text, responses.CompletionChunk)):
        model.model_validate(chunk)
    with pytest.raises(ValueError):  # a field no model declares is never sent
        responses.ChatCompletionChunk.model_validate({**first, "extra": 1})


def test_the_request_schemas_list_what_is_accepted_and_nothing_else():
    chat = p.ChatRequest.model_json_schema()
    assert chat["additionalProperties"] is False
    assert {"user", "metadata", "tools", "logprobs", "k", "module_ids"} <= set(chat["properties"])
    assert chat["properties"]["tools"] == {"anyOf": [{"const": []}, {"type": "null"}]}
    assert chat["properties"]["n"]["anyOf"] == [{"const": 1}, {"type": "null"}]
    completion = p.CompletionRequest.model_json_schema()
    assert completion["properties"]["prompt"]["anyOf"][1]["maxItems"] == 1
    assert p.EmbeddingRequest.model_json_schema()["additionalProperties"] is False


@pytest.mark.parametrize(("body", "where"), [
    ({**CHAT, "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages.0.content"),
    ({**CHAT, "stop": ["ok", "\udfff"]}, "stop.1"),
    ({"model": "m", "prompt": ["\ud83d"]}, "prompt.0"),
])
def test_text_that_is_not_unicode_is_refused_where_it_is(body, where):
    """Found by fuzzing the server: JSON may escape a lone UTF-16 surrogate ("\\ud800"), which no tokenizer
    takes (a 500)."""
    from pydantic import ValidationError

    model = p.CompletionRequest if "prompt" in body else p.ChatRequest
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    assert e.value.errors()[0]["ctx"]["field"] == where and "not Unicode text" in e.value.errors()[0]["msg"]
    with pytest.raises(ValidationError):
        p.EmbeddingRequest.model_validate({"model": "m", "input": ["fine", "\ud800"]})


def test_bounds_and_whole_numbers_as_the_schema_states_them():
    assert p.ChatRequest.model_validate({**CHAT, "max_tokens": 3.0, "k": 2.0}).max_tokens == 3
    for bad in ({"max_tokens": 3.5}, {"max_tokens": "3"}, {"seed": 2**64}, {"user": 5}, {"metadata": {"a": 1}},
                {"frequency_penalty": False}):
        body = p.ChatRequest.model_validate({**CHAT, **bad}) if "frequency_penalty" in bad else None
        if body is not None:  # false is not 0 to JSON Schema's const, so it is not the "off" value
            assert body.refused()[0] == "frequency_penalty"
            continue
        with pytest.raises(ValueError):
            p.ChatRequest.model_validate({**CHAT, **bad})


def test_routes_are_small_named_handlers():
    """STYLE.md's sixth stage: one named handler per route at module level (as FastAPI's examples and vLLM's
    api_server write them), and `create_app` only assembles the app."""
    import inspect

    from rag_promptcache.server import app

    endpoints = {(sorted(route.methods)[0], route.path): route.endpoint for route in app.router.routes}
    assert set(endpoints) == {("GET", "/"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
                              ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/embeddings")}
    for handler in endpoints.values():
        assert handler.__qualname__ == handler.__name__ and getattr(app, handler.__name__) is handler
        assert len(inspect.getsource(handler).splitlines()) <= 30, handler.__name__
    assert len(inspect.getsource(app.create_app).splitlines()) <= 30


@pytest.mark.parametrize(("body", "param"), [
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({**CHAT, "max_tokens": "ten"}, "max_tokens"),
    ({**CHAT, "messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
])
def test_a_validation_error_names_the_field_not_the_union_member(body, param):
    import asyncio

    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from rag_promptcache.server.app import invalid_request

    with pytest.raises(ValidationError) as e:
        p.ChatRequest.model_validate(body)
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]  # as FastAPI reports them
    response = asyncio.run(invalid_request(None, RequestValidationError(errors)))
    assert response.status_code == 400 and json.loads(response.body)["error"]["param"] == param
