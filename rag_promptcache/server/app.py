"""The HTTP app: OpenAI-compatible routes over one corpus and one continuous-batching scheduler.

    GET  /                      the chat page (static/index.html: one file, no build step)
    GET  /v1/models             the one model; its id is the corpus directory's name, its `schema` the
                                PML schema name that /v1/completions prompts import modules from, its
                                `adapter` the tuned adapter merged into the model (null: the base model)
    POST /v1/chat/completions   retrieve k modules, answer from their cached KV (SSE when stream)
    POST /v1/completions        a raw prompt: PML or plain text
    POST /v1/embeddings         the corpus's embedder (server/embeddings.py)
    GET  /metrics               Prometheus' text format (server/metrics.py); needs the API key like /v1
    GET  /health                for load balancers; never needs the API key (server/auth.py)

This layer only translates types: retrieval and prompts are `rag.chat.CorpusChat`, generation is the
engine's `Batcher`. Errors are OpenAI-shaped: bad input 400 (404 for an unknown model), a request
field we do not implement 400 naming it, a missing or wrong API key 401, a full queue 429 with
Retry-After, a failure inside one request 500 for that request only: "internal error" and a request
id (body and `x-request-id` header), the traceback in the server's log, never in the response.
Not here: TLS, rate limits per client (put a reverse proxy in front).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag_promptcache.engine import ContextWindowExceeded
from rag_promptcache.engine.batching.batcher import Batcher, Handle
from rag_promptcache.engine.result import Result, fixed_stream
from rag_promptcache.engine.batching.scheduler import QueueFull
from rag_promptcache.rag.chat import ChatPrompt, CorpusChat
from rag_promptcache.rag.retrieval import NOT_FOUND
from rag_promptcache.server import protocol as p
from rag_promptcache.server.access_log import AccessLog, new_request_id
from rag_promptcache.server.auth import RequireKey
from rag_promptcache.server.embeddings import Embeddings
from rag_promptcache.server.metrics import CountStatuses, Metrics

RETRY_AFTER_S = 1
log = logging.getLogger("rag_promptcache.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type, headers


def internal_error(where: str, e: BaseException, rid: str | None = None) -> tuple[str, dict[str, object]]:
    """Log the traceback under the request's id (a new one without); the client gets the id, never the
    exception's text."""
    rid = rid or new_request_id()
    log.error("internal error in %s (request id %s)", where, rid, exc_info=e)
    return rid, p.error(f"internal error (request id {rid}); the server's log has the details", "server_error")


def page() -> str:
    return resources.files("rag_promptcache.server").joinpath("static/index.html").read_text(encoding="utf-8")


class NotFound:
    """A handle for the answer given without generating when no chunk scores `min_score`: no batcher row."""

    def __init__(self) -> None:
        self._stream = fixed_stream(NOT_FOUND)
        self.result: Result | None = None

    def __aiter__(self) -> NotFound:
        return self

    async def __anext__(self) -> str:
        piece = next(self._stream, None)
        if piece is None:
            self.result = self._stream.result
            raise StopAsyncIteration
        return piece

    def cancel(self) -> None:
        pass


def create_app(chat: CorpusChat, batcher: Batcher, *, model_id: str, k: int = 4, api_key: str | None = None,
               min_score: float | None = None) -> FastAPI:
    app = FastAPI(title="rag-promptcache", docs_url=None, redoc_url=None)
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    metrics = Metrics(batcher, chat.corpus.engine, chat.corpus.coverage)
    app.add_middleware(CountStatuses, metrics=metrics)  # outside the key check: 401s are counted too
    app.add_middleware(AccessLog)  # outermost: it logs the 401s too
    schema = chat.corpus.manifest.name
    aliases = {model_id, schema, chat.corpus.engine.model_name}
    window = chat.corpus.engine.context_window
    embeddings = Embeddings(chat.corpus.embedder)
    adapter = chat.corpus.engine.adapter_name  # the tuned adapter merged into the weights; None: the base model
    html = page()  # read once: a missing file fails at start-up, not on the first visit

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(p.error(str(e), e.type, e.param, e.code), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
            at = f" at byte {loc[0]}" if loc else ""
            return JSONResponse(p.error(f"the body is not valid JSON{at}: {first.get('msg')}"), status_code=400)
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}"
        return JSONResponse(p.error(message, param=".".join(loc) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(p.error(str(e.detail), code=str(e.status_code)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        rid, body = internal_error(f"{request.method} {request.url.path}", e, getattr(request.state, "request_id", None))
        return JSONResponse(body, status_code=500, headers={"x-request-id": rid})

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(html)

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "model": model_id, "running": batcher.num_running, "waiting": batcher.num_waiting,
                "max_batch": batcher.rows.max_batch, "max_queue": batcher.rows.max_queue}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "rag-promptcache", "root": chat.corpus.engine.model_name,
                                            "max_model_len": window, "schema": schema,
                                            "embedder": embeddings.name, "adapter": adapter}]}

    def check(body: p.GenerationRequest | p.EmbeddingRequest, *extra: str) -> None:
        if body.model not in aliases | set(extra):
            raise ApiError(404, f"unknown model {body.model!r}; this server serves {model_id!r}",
                           param="model", code="model_not_found")
        if refused := body.refused():
            raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")

    async def submit(build: Callable[[], ChatPrompt], body: p.GenerationRequest,
                     max_tokens: int | None) -> tuple[Handle | NotFound, ChatPrompt, list[dict[str, object]]]:
        def work() -> tuple[Handle | NotFound, ChatPrompt, list[dict[str, object]]]:
            built = build()
            if built.not_found:
                return NotFound(), built, []
            found = p.sources(built.sources, chat.corpus.text)
            return batcher.submit(built.prompt, recovery=body.recovery, ignore_eos=body.ignore_eos,
                                  **body.sampling(max_tokens)), built, found
        try:
            return await run_in_threadpool(work)
        except QueueFull as e:
            raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except ContextWindowExceeded as e:  # the engine's option is max_new_tokens; the API's, max_tokens
            field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            prompt_field = "messages" if isinstance(body, p.ChatRequest) else "prompt"
            raise ApiError(400, str(e).replace("max_new_tokens", field), code="context_length_exceeded",
                           param=field if e.max_new_fits else prompt_field) from e
        except ValueError as e:
            # a schema the grammar library cannot use is found at submit; its message starts with the field
            raise ApiError(400, str(e), param="response_format" if str(e).startswith("response_format") else None) from e

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatRequest, request: Request):
        check(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        handle, built, found = await submit(lambda: chat.chat_prompt(
            body.turns(), k=body.k or k, module_ids=body.module_ids, max_new_tokens=max_tokens or p.DEFAULT_MAX_TOKENS,
            min_score=min_score if body.min_score is None else body.min_score), body, max_tokens)
        request.state.handle = handle  # the access log reads its result
        rid = p.new_id("chatcmpl")
        if not body.stream:
            result = await _drain(metrics.pieces(handle), handle, request)
            return p.chat_response(rid, model_id, result, found)

        async def events() -> AsyncIterator[str]:
            yield json.dumps(p.chat_chunk(rid, model_id, {"role": "assistant", "content": ""},
                                          sources=found))
            async for piece in metrics.pieces(handle):
                yield json.dumps(p.chat_chunk(rid, model_id, {"content": piece}))
            assert handle.result is not None
            yield json.dumps(p.chat_chunk(rid, model_id, {}, p.FINISH[handle.result.finish_reason]))
            if body.include_usage:
                yield json.dumps({**p.chat_chunk(rid, model_id, {}), "choices": [], "usage": p.usage(handle.result)})

        return _sse(events(), handle)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request):
        check(body)
        try:
            text = body.text()
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt") from e
        handle, _, _ = await submit(lambda: chat.completion_prompt(text), body, body.max_tokens)
        request.state.handle = handle
        rid = p.new_id("cmpl")
        if not body.stream:
            return p.completion_response(rid, model_id, await _drain(metrics.pieces(handle), handle, request))

        async def events() -> AsyncIterator[str]:
            async for piece in metrics.pieces(handle):
                yield json.dumps(p.completion_chunk(rid, model_id, piece))
            assert handle.result is not None
            yield json.dumps(p.completion_chunk(rid, model_id, "", p.FINISH[handle.result.finish_reason]))
            if body.include_usage:
                yield json.dumps({**p.completion_chunk(rid, model_id, ""), "choices": [], "usage": p.usage(handle.result)})

        return _sse(events(), handle)

    @app.post("/v1/embeddings")
    async def embed(body: p.EmbeddingRequest) -> dict[str, object]:
        check(body, embeddings.name)
        if body.dimensions is not None and body.dimensions != embeddings.embedder.dim:
            raise ApiError(400, f"dimensions={body.dimensions}: the embedder {embeddings.name} returns "
                                f"{embeddings.embedder.dim}-dimensional vectors and cannot shorten them; omit dimensions",
                           param="dimensions", code="unsupported_parameter")
        try:
            texts = body.texts()
            vectors, num_tokens = await run_in_threadpool(embeddings.embed, texts)
        except ValueError as e:
            raise ApiError(400, str(e), param="input") from e
        return p.embeddings_response(body.model, vectors, num_tokens, body.encoding_format)

    return app


def _sse(events: AsyncIterator[str], handle: Handle | NotFound) -> EventSourceResponse:
    async def framed() -> AsyncIterator[dict[str, str]]:
        try:
            async for data in events:
                yield {"data": data}
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream, then [DONE]
            yield {"data": json.dumps(internal_error("a stream", e)[1])}
        finally:
            handle.cancel()  # a client gone mid-stream frees its row now; a no-op once finished
        yield {"data": "[DONE]"}

    return EventSourceResponse(framed(), ping=15)


async def _drain(pieces: AsyncIterator[str], handle: Handle | NotFound, request: Request) -> Result:
    """Wait for the whole answer (`pieces`: the handle's); a client that hangs up meanwhile cancels it."""
    done = asyncio.ensure_future(_consume(pieces, handle))
    try:
        while True:
            finished, _ = await asyncio.wait({done}, timeout=0.5)
            if finished:
                return done.result()
            if await request.is_disconnected():
                handle.cancel()
                raise ApiError(499, "client disconnected")
    finally:
        if not done.done():
            handle.cancel()


async def _consume(pieces: AsyncIterator[str], handle: Handle | NotFound) -> Result:
    async for _ in pieces:
        pass
    assert handle.result is not None
    return handle.result

