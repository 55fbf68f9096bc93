"""The HTTP app: OpenAI-compatible routes over one or more corpora, a continuous-batching scheduler each
(corpora on one engine share it); a request's `model` picks the corpus (served.py).

    GET  /                      the chat page (static/index.html: one file, no build step)
    GET  /v1/models             each corpus: its id is the corpus directory's name, its `schema` the
                                PML schema name that /v1/completions prompts import modules from, its
                                `adapter` the tuned adapter merged into the model (null: the base model),
                                its size (`num_documents`, `num_modules`, `num_tokens`)
    POST /v1/chat/completions   retrieve k modules, answer from their cached KV (SSE when stream)
    POST /v1/completions        a raw prompt: PML or plain text
    POST /v1/embeddings         the corpus's embedder (server/embeddings.py)
    GET  /metrics               Prometheus' text format (server/metrics.py); needs the API key like /v1
    GET  /health                for load balancers; never needs the API key (server/auth.py)
    GET  /openapi.json          the schema of all of the above (server/openapi.py)

Each route is a small handler, as FastAPI's examples and vLLM's api_server write them: what it serves
(`Serving`, made once by `create_app`) is on `request.app.state`. This layer only translates types:
retrieval and prompts are `rag.chat.CorpusChat`, generation is the engine's `Batcher`, bodies are
`protocol.py`'s (in) and `responses.py`'s (out). Errors are OpenAI-shaped: bad input 400 (404 for an
unknown model), a request field we do not implement 400 naming it, a missing or wrong API key 401, a
full queue 429 with Retry-After, a failure inside one request 500 for that request only: "internal
error" and a request id (body and `x-request-id` header), the traceback in the server's log, never in
the response.
Not here: TLS, rate limits per client (put a reverse proxy in front).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import resources

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from rag_promptcache.engine import ContextWindowExceeded
from rag_promptcache.engine.batching.batcher import Batcher, Handle
from rag_promptcache.engine.batching.scheduler import QueueFull
from rag_promptcache.engine.result import Result, fixed_stream
from rag_promptcache.rag.chat import ChatPrompt, CorpusChat
from rag_promptcache.rag.retrieval import MIN_ANSWER_TOKENS, NOT_FOUND
from rag_promptcache.server import openapi
from rag_promptcache.server import protocol as p
from rag_promptcache.server import responses as r
from rag_promptcache.server.access_log import AccessLog, new_request_id
from rag_promptcache.server.auth import RequireKey
from rag_promptcache.server.embeddings import Embeddings
from rag_promptcache.server.metrics import CountStatuses, Metrics, Watched
from rag_promptcache.server.served import ModelNotFound, Served, Serving

RETRY_AFTER_S = 1
TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})
FIT_TRIES = 3  # retrieval's estimate of the prompt, then the plan's count: the default answer length fits in two
log = logging.getLogger("rag_promptcache.server")
router = APIRouter()


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type, headers


def served(request: Request) -> Serving:
    return request.app.state.served


def create_app(corpora: list[tuple[CorpusChat, Batcher, str]], *, k: int = 4, api_key: str | None = None,
               min_score: float | None = None) -> FastAPI:
    """The app over `corpora`: (chat, batcher, model id) each, in the order /v1/models lists them."""
    app = FastAPI(title="rag-promptcache", docs_url=None, redoc_url=None)
    each = tuple(Served(chat, batcher, Embeddings(chat.corpus.embedder), model_id) for chat, batcher, model_id in corpora)
    metrics = Metrics([Watched(x.model_id, x.batcher, x.chat.corpus.engine, lambda c=x.chat.corpus: c.store,
                               x.chat.corpus.coverage) for x in each])
    app.state.served = s = Serving(each, metrics, k, min_score, page())
    if api_key is not None:
        app.add_middleware(RequireKey, key=api_key)
    app.add_middleware(CountStatuses, metrics=metrics)  # outside the key check: 401s are counted too
    app.add_middleware(AccessLog)  # outermost: it logs the 401s too
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)
    app.include_router(router)
    app.openapi = lambda: openapi.schema(app, served=s.names, embedders=[x.embeddings for x in each],
                                         window=max(x.chat.corpus.engine.context_window for x in each),
                                         secured=api_key is not None)
    return app


# -- errors ---------------------------------------------------------------------------------------------

async def api_error(_: Request, e: ApiError) -> JSONResponse:
    return JSONResponse(r.error(str(e), e.type, e.param, e.code), status_code=e.status, headers=e.headers)


async def invalid_request(_: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {"msg": "invalid request", "loc": ()}
    # pydantic names the member a union tried ("stop.str", "messages.0.content.list[TextPart]"): not a field
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not (x in TYPE_TAGS or "[" in str(x))]
    if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
        at = f" at byte {loc[0]}" if loc else ""
        return JSONResponse(r.error(f"the body is not valid JSON{at}: {first.get('msg')}"), status_code=400)
    where = (first.get("ctx") or {}).get("field")  # an error that names its own field (protocol.py)
    if where is not None:
        return JSONResponse(r.error(str(first.get("msg")), param=where), status_code=400)
    message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}"
    return JSONResponse(r.error(message, param=".".join(loc) or None), status_code=400)


async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    # a 405's Allow header is kept
    return JSONResponse(r.error(str(e.detail), code=str(e.status_code)), status_code=e.status_code, headers=e.headers)


async def internal(request: Request, e: Exception) -> JSONResponse:
    rid, body = internal_error(f"{request.method} {request.url.path}", e, getattr(request.state, "request_id", None))
    return JSONResponse(body, status_code=500, headers={"x-request-id": rid})


def internal_error(where: str, e: BaseException, rid: str | None = None) -> tuple[str, dict[str, object]]:
    """Log the traceback under the request's id (a new one without); the client gets the id, never the
    exception's text."""
    rid = rid or new_request_id()
    log.error("internal error in %s (request id %s)", where, rid, exc_info=e)
    return rid, r.error(f"internal error (request id {rid}); the server's log has the details", "server_error")


# -- routes ---------------------------------------------------------------------------------------------

@router.get("/", response_class=HTMLResponse, **openapi.PAGE)
async def index(request: Request) -> HTMLResponse:
    return HTMLResponse(served(request).html)


@router.get("/health", response_model=r.Health, **openapi.READ)
async def health(request: Request) -> r.Health:
    s = served(request)
    first, batchers = s.corpora[0], s.batchers
    return r.Health(status="ok", model=first.model_id, models=[x.model_id for x in s.corpora], num_batchers=len(batchers),
                    running=sum(b.num_running for b in batchers), waiting=sum(b.num_waiting for b in batchers),
                    max_batch=first.batcher.rows.max_batch, max_queue=first.batcher.rows.max_queue,
                    background_queue=sum(b.engine.background.stats().num_queued for b in batchers))


@router.get("/metrics", response_class=Response, **openapi.METRICS)
async def prometheus(request: Request) -> Response:
    body, content_type = served(request).metrics.render()
    return Response(body, media_type=content_type)


@router.get("/v1/models", response_model=r.ModelList, **openapi.READ)
async def list_models(request: Request) -> r.ModelList:
    corpora = served(request).corpora  # each card counts its corpus's table: in a thread, as retrieval reads it
    return r.ModelList(object="list", data=await run_in_threadpool(lambda: [x.model_card() for x in corpora]))


@router.post("/v1/chat/completions", response_model=r.ChatCompletion, **openapi.generation(r.ChatCompletionChunk))
async def create_chat_completion(body: p.ChatRequest, request: Request) -> r.ChatCompletion | EventSourceResponse:
    all_ = served(request)
    s = check(all_, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    handle, _, found = await submit(s, lambda n: s.chat.chat_prompt(
        body.turns(), k=body.k or all_.k, module_ids=body.module_ids, max_new_tokens=n,
        min_score=all_.min_score if body.min_score is None else body.min_score, filter=body.filter), body, max_tokens)
    request.state.handle = handle  # the access log reads its result
    rid = r.new_id("chatcmpl")
    pieces = all_.metrics.pieces(handle, s.model_id)
    if not body.stream:
        return r.chat_response(rid, s.model_id, await _drain(pieces, handle, request), found)

    async def events() -> AsyncIterator[str]:
        yield r.chat_chunk(rid, s.model_id, r.Delta(role="assistant", content=""), sources=found)
        async for piece in pieces:
            yield r.chat_chunk(rid, s.model_id, r.Delta(content=piece))
        assert handle.result is not None
        yield r.chat_chunk(rid, s.model_id, r.Delta(), r.FINISH[handle.result.finish_reason])
        if body.include_usage:
            yield r.chat_chunk(rid, s.model_id, None, usage=r.usage(handle.result))

    return _sse(events(), handle)


@router.post("/v1/completions", response_model=r.Completion, **openapi.generation(r.CompletionChunk))
async def create_completion(body: p.CompletionRequest, request: Request) -> r.Completion | EventSourceResponse:
    all_ = served(request)
    s = check(all_, body)
    try:
        text = body.text()
    except ValueError as e:
        raise ApiError(400, str(e), param="prompt") from e
    handle, _, _ = await submit(s, lambda _: s.chat.completion_prompt(text), body, body.max_tokens)
    request.state.handle = handle
    rid = r.new_id("cmpl")
    pieces = all_.metrics.pieces(handle, s.model_id)
    if not body.stream:
        return r.completion_response(rid, s.model_id, await _drain(pieces, handle, request))

    async def events() -> AsyncIterator[str]:
        async for piece in pieces:
            yield r.completion_chunk(rid, s.model_id, piece)
        assert handle.result is not None
        yield r.completion_chunk(rid, s.model_id, "", r.FINISH[handle.result.finish_reason])
        if body.include_usage:
            yield r.completion_chunk(rid, s.model_id, None, usage=r.usage(handle.result))

    return _sse(events(), handle)


@router.post("/v1/embeddings", response_model=r.EmbeddingList, **openapi.ERRORS)
async def create_embedding(body: p.EmbeddingRequest, request: Request) -> r.EmbeddingList:
    s = check(served(request), body, embedding=True)
    if body.dimensions is not None and body.dimensions != s.embeddings.embedder.dim:
        raise ApiError(400, f"dimensions={body.dimensions}: the embedder {s.embeddings.name} returns "
                            f"{s.embeddings.embedder.dim}-dimensional vectors and cannot shorten them; omit dimensions",
                       param="dimensions", code="unsupported_parameter")
    try:
        texts = body.texts()
        vectors, num_tokens = await run_in_threadpool(s.embeddings.embed, texts)
    except ValueError as e:
        raise ApiError(400, str(e), param="input") from e
    return r.embeddings_response(body.model, vectors, num_tokens, body.encoding_format)


# -- what the routes share ------------------------------------------------------------------------------

def check(all_: Serving, body: p.GenerationRequest | p.EmbeddingRequest, *, embedding: bool = False) -> Served:
    """The corpus the model named is (404 where none is), once no field is one we do not implement (400)."""
    try:
        s = all_.find(body.model, embedding=embedding)
    except ModelNotFound as e:
        raise ApiError(404, str(e), param="model", code="model_not_found") from e
    if refused := body.refused():
        raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")
    return s


async def submit(s: Served, build: Callable[[int], ChatPrompt], body: p.GenerationRequest,
                 max_tokens: int | None) -> tuple[Handle | NotFound, ChatPrompt, list[r.SourceOut]]:
    """Build the prompt for an answer of up to n tokens (`build(n)`) and queue it, in a thread: retrieval
    and planning run models. A request that sets no `max_tokens` gets `DEFAULT_MAX_TOKENS`, or what the
    context window leaves when that is less (OpenAI's default is the window's rest; an answer that then
    reaches it ends "length"), but never under MIN_ANSWER_TOKENS: a prompt that leaves less is refused,
    not answered with a token or two. The engine's refusals become the API's errors, naming the API's
    own fields."""
    def work() -> tuple[Handle | NotFound, ChatPrompt, list[r.SourceOut]]:
        limit = max_tokens or p.DEFAULT_MAX_TOKENS
        for _ in range(FIT_TRIES):
            try:
                return queue(limit)
            except ContextWindowExceeded as e:
                if max_tokens is not None or not e.max_new_fits or e.max_new_fits >= limit:
                    raise
                if e.max_new_fits < MIN_ANSWER_TOKENS:
                    window = s.chat.corpus.engine.context_window
                    raise ContextWindowExceeded(f"the prompt leaves {e.max_new_fits} tokens of the model's {window}-token "
                                                f"context window for the answer, under the least an answer is given "
                                                f"({MIN_ANSWER_TOKENS}): shorten the prompt") from e
                limit = e.max_new_fits
        return queue(limit)

    def queue(limit: int) -> tuple[Handle | NotFound, ChatPrompt, list[r.SourceOut]]:
        built = build(limit)
        if built.not_found:
            return NotFound(), built, []
        found = r.sources(built.sources)
        return s.batcher.submit(built.prompt, recovery=body.recovery, ignore_eos=body.ignore_eos,
                                **body.sampling(limit)), built, found
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
    except ValidationError:
        raise  # one of our own response bodies failed its model: a server bug, answered 500, not the client's
    except ValueError as e:
        raise ApiError(400, str(e), param=_param_of(str(e), body)) from e


def _param_of(message: str, body: p.GenerationRequest) -> str | None:
    """The request field a refusal from below is about: the field it starts with (the engine's sampling
    options and the grammar's schema errors name theirs first), else what the prompt was built from."""
    first = message.split(" ", 1)[0].rstrip(":")
    if first in type(body).model_fields:
        return first
    if body.recovery is not None and (body.recovery in message or "recovery" in message):
        return "recovery"
    if isinstance(body, p.ChatRequest):
        return "module_ids" if "module id" in message else "messages"
    return "prompt"


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
