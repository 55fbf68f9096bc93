"""The HTTP app: OpenAI-compatible routes over one corpus and one continuous-batching scheduler.

    GET  /v1/models             the one model; its id is the corpus directory's name
    POST /v1/chat/completions   retrieve k modules, answer from their cached KV (SSE when stream)
    POST /v1/completions        a raw prompt: PML or plain text
    GET  /health                for load balancers

This layer only translates types: retrieval and prompts are `rag.chat.CorpusChat`, generation is the
engine's `Batcher`. Errors are OpenAI-shaped: bad input 400 (404 for an unknown model), a full queue
429 with Retry-After, a failure inside one request 500 for that request only.
Not here: auth, TLS, rate limits per client (put a reverse proxy in front).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag_promptcache.engine.batcher import Batcher, Handle
from rag_promptcache.engine.result import Result
from rag_promptcache.engine.scheduler import QueueFull
from rag_promptcache.rag.chat import ChatPrompt, CorpusChat
from rag_promptcache.server import protocol as p

RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type, headers


def create_app(chat: CorpusChat, batcher: Batcher, *, model_id: str, k: int = 4) -> FastAPI:
    app = FastAPI(title="rag-promptcache", docs_url=None, redoc_url=None)
    aliases = {model_id, chat.corpus.manifest.name, chat.corpus.engine.model_name}
    window = chat.corpus.engine.context_window

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(p.error(str(e), e.type, e.param, e.code), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('msg')}"
        else:
            message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}"
        return JSONResponse(p.error(message, param=".".join(loc) or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(p.error(str(e.detail), code=str(e.status_code)), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(p.error(f"internal error: {type(e).__name__}: {e}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {"status": "ok", "model": model_id, "running": batcher.num_running, "waiting": batcher.num_waiting,
                "max_batch": batcher.rows.max_batch, "max_queue": batcher.rows.max_queue}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0,
                                            "owned_by": "rag-promptcache", "root": chat.corpus.engine.model_name,
                                            "max_model_len": window}]}

    def check(body: p._Generation) -> None:
        if body.model not in aliases:
            raise ApiError(404, f"unknown model {body.model!r}; this server serves {model_id!r}",
                           param="model", code="model_not_found")
        if body.n not in (None, 1):
            raise ApiError(400, f"n={body.n}: this server returns one choice per request (n must be 1)", param="n")

    async def submit(build: Callable[[], ChatPrompt], body: p._Generation, max_tokens: int | None) -> tuple[Handle, ChatPrompt]:
        def work() -> tuple[Handle, ChatPrompt]:
            built = build()
            return batcher.submit(built.prompt, recovery=body.recovery, ignore_eos=body.ignore_eos,
                                  **body.sampling(max_tokens)), built
        try:
            return await run_in_threadpool(work)
        except QueueFull as e:
            raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except ValueError as e:
            code = "context_length_exceeded" if "window" in str(e) else None
            raise ApiError(400, str(e), code=code) from e

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatRequest, request: Request):
        check(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        handle, built = await submit(lambda: chat.chat_prompt(
            body.turns(), k=body.k or k, module_ids=body.module_ids,
            max_new_tokens=max_tokens or p.DEFAULT_MAX_TOKENS), body, max_tokens)
        rid = p.new_id("chatcmpl")
        if not body.stream:
            result = await _drain(handle, request)
            return p.chat_response(rid, model_id, result, built.sources)

        async def events() -> AsyncIterator[str]:
            yield json.dumps(p.chat_chunk(rid, model_id, {"role": "assistant", "content": ""},
                                          sources=p.sources(built.sources)))
            async for piece in handle:
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
        handle, _ = await submit(lambda: chat.completion_prompt(text), body, body.max_tokens)
        rid = p.new_id("cmpl")
        if not body.stream:
            return p.completion_response(rid, model_id, await _drain(handle, request))

        async def events() -> AsyncIterator[str]:
            async for piece in handle:
                yield json.dumps(p.completion_chunk(rid, model_id, piece))
            assert handle.result is not None
            yield json.dumps(p.completion_chunk(rid, model_id, "", p.FINISH[handle.result.finish_reason]))
            if body.include_usage:
                yield json.dumps({**p.completion_chunk(rid, model_id, ""), "choices": [], "usage": p.usage(handle.result)})

        return _sse(events(), handle)

    return app


def _sse(events: AsyncIterator[str], handle: Handle) -> EventSourceResponse:
    async def framed() -> AsyncIterator[dict[str, str]]:
        try:
            async for data in events:
                yield {"data": data}
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - headers are sent: the error goes in the stream, then [DONE]
            yield {"data": json.dumps(p.error(f"internal error: {type(e).__name__}: {e}", "server_error"))}
        finally:
            handle.cancel()  # a client gone mid-stream frees its row now; a no-op once finished
        yield {"data": "[DONE]"}

    return EventSourceResponse(framed(), ping=15)


async def _drain(handle: Handle, request: Request) -> Result:
    """Wait for the whole answer; a client that hangs up meanwhile cancels it."""
    done = asyncio.ensure_future(_consume(handle))
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


async def _consume(handle: Handle) -> Result:
    async for _ in handle:
        pass
    assert handle.result is not None
    return handle.result

