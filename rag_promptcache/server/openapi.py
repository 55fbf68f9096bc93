"""The server's OpenAPI schema (`GET /openapi.json`), made to say exactly what the server does, so that a
client generator or a fuzzer (schemathesis: tests/test_server_fuzz.py, `python -m benchmarks.soak --fuzz` in a checkout) can hold
it to that.

FastAPI writes the schema from the routes' request and response models; this adds what it cannot know:
- every error status a route answers, each with the one error body (`responses.ErrorResponse`), and none
  of FastAPI's own 422 (a malformed body is a 400 here);
- a stream's body (`text/event-stream`): each event's data, a chunk as JSON, an error as JSON if the
  answer failed mid-way, or the final "[DONE]";
- what only the running server knows: the model names it serves (an enum), the longest `max_tokens` its
  context window allows, its embedder's one `dimensions`, and whether an API key is required (the
  bearer scheme on every route but `/health` and the page).

Not here: the routes themselves (`app.py`), the bodies (`protocol.py`, `responses.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from rag_promptcache.server import responses as r

if TYPE_CHECKING:
    from collections.abc import Sequence

    from fastapi import FastAPI

    from rag_promptcache.server.embeddings import Embeddings

REF = "#/components/schemas/{model}"
OPEN_ROUTES = ("/health", "/")  # never need the API key (auth.py OPEN_PATHS)


def _errors(*statuses: int) -> dict[int, dict[str, object]]:
    why = {400: "A malformed request, or a field this server does not implement (named in `param`).",
           404: "An unknown model.", 429: "The queue is full: retry after `Retry-After` seconds.",
           500: "A failure inside this request (the server's log has it under `x-request-id`)."}
    return {status: {"model": r.ErrorResponse, "description": why[status]} for status in statuses}


def _stream(chunk: type[BaseModel]) -> dict[str, object]:
    """A stream's events (the schema of one, as Open API before 3.2 reads `schema` for an event stream):
    each one's data is a chunk as JSON, or an error as JSON where the answer failed after it began, or the
    final "[DONE]"."""
    payload = {"anyOf": [{"$ref": REF.format(model=chunk.__name__)}, {"$ref": REF.format(model="ErrorResponse")}]}
    data = {"anyOf": [{"const": "[DONE]"},
                      {"type": "string", "contentMediaType": "application/json", "contentSchema": payload}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"description": "With `stream`: server-sent events, each one's data a chunk; the last data is [DONE].",
            "content": {"text/event-stream": {"schema": event}}}


# keyword arguments of the routes (app.py)
ERRORS = {"responses": _errors(400, 404, 500)}
READ = {"responses": _errors(500)}
PAGE = {"responses": {200: {"description": "The chat page.", "content": {"text/html": {"schema": {"type": "string"}}}}}}
METRICS = {"responses": {200: {"description": "Prometheus' text format.",
                               "content": {"text/plain": {"schema": {"type": "string"}}}}}}


def generation(chunk: type[BaseModel]) -> dict[str, object]:
    """A generating route's statuses; its stream's events are `chunk`s."""
    out = _errors(400, 404, 429, 500)
    out[200] = _stream(chunk)
    return {"responses": out}


def schema(app: FastAPI, *, served: list[str], embedders: Sequence[Embeddings], window: int,
           secured: bool) -> dict[str, object]:
    """The app's schema (made once, then kept on the app, as FastAPI's own `openapi()` does); `served`: the
    names a request's `model` may use, `embedders`: the served corpora's."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(m, "serialization") for m in (r.ChatCompletionChunk, r.CompletionChunk)],
                                 ref_template=REF)
    components.update(defs.get("$defs", {}))
    for name in ("ValidationError", "HTTPValidationError"):
        components.pop(name, None)
    for body in ("ChatRequest", "CompletionRequest", "EmbeddingRequest"):
        props = components[body]["properties"]
        names = [*served, *sorted({e.name for e in embedders} - set(served))] if body == "EmbeddingRequest" else served
        props["model"] = {"type": "string", "enum": names, "title": "Model"}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": window}, {"type": "null"}],
                                "title": field.replace("_", " ").title()}
    components["EmbeddingRequest"]["properties"]["dimensions"] = {
        "anyOf": [*({"const": dim} for dim in sorted({e.embedder.dim for e in embedders})), {"type": "null"}],
        "title": "Dimensions"}
    if secured:
        components_root = spec["components"]
        components_root["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if secured and path not in OPEN_ROUTES:
                operation["security"] = [{"bearer": []}]
                operation["responses"]["401"] = {
                    "description": "A missing or wrong API key.",
                    "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}}
    app.openapi_schema = spec
    return spec
