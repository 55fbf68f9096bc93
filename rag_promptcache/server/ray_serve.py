"""`serve --ray`: the same OpenAI app as `serve`, as a Ray Serve deployment of N replicas, or of a range
that Ray Serve's own autoscaler moves within.

Each replica is one Ray actor that opens the same corpora (`serve --ray --corpus A --corpus B`: every
replica serves all of them, corpora on one model sharing it as `serve` does), loads its own engine per
model (memory tier, then the shared Redis tier when one is configured: no disk tier, so replicas on one
machine do not contend for one directory) and builds the app with `server.build`; `serve.ingress` takes
that builder, so the routes, streaming, the page and the API key are the app's own. Before each request
a replica calls `Corpus.refresh()` on each corpus: an `ingest` made meanwhile (by anyone) is seen by the
next request, never half-way through one. Each response names its replica in `x-replica`.

Without `--ray-address` a local cluster is started here and stopped on exit; with one, the address
is probed first, so an unreachable cluster fails in seconds instead of Ray's own minute of retries.
The corpus paths must be readable at the same paths on every node, with the package installed there.

A replica takes up to two batches of requests at once (`max_ongoing_requests`; Ray Serve's router
queues the rest and hands each to the first replica with room), and with `autoscale` Ray Serve aims at
one full batch per replica. A replica that dies mid-response cannot end its response; Ray Serve's
proxy then cuts the connection. `EndCutResponses`, installed in the proxies of a Serve instance
started here, ends such a response instead: an OpenAI error event and `[DONE]` for a stream, a 500 with
an OpenAI error body for a response not yet begun. Ray Serve replaces the dead replica.

Not here: an autoscaling policy of our own, the shutdown of a replica's open streams (Ray Serve's own).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.middleware import Middleware
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

INSTALL_HINT = "serve --ray needs Ray Serve: pip install 'rag-promptcache[ray]'"
APP_NAME = "rag-promptcache"
DEPLOYMENT = "PromptCacheReplica"
# read by Ray Serve's proxies when they start: a function returning the middlewares they wrap themselves in
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
# read by Serve's controller: how long a starting proxy may take to answer that it is ready. Ray's 5 s, missed
# three times, has the controller kill the proxy and `serve.start` fail (ActorDiedError) on a node whose cores
# are busy (replicas loading their models, another job); 30 s, unless the environment sets its own
PROXY_READY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "30"}
CUT_MESSAGE = ("the replica answering this request stopped before finishing it (Ray Serve replaces it); "
               "send the request again")


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """What every replica is built with (sent to the replicas by value)."""

    corpus: str | tuple[str, ...]  # one corpus, or several (each a corpus directory)
    k: int = 4
    max_batch: int = 8
    max_queue: int = 64
    redis_url: str | None = None  # None: $RAG_PROMPTCACHE_REDIS_URL where the deployment starts; "": none
    dtype: str | None = None
    api_key: str | None = None
    prefill_chunk: int | None = None
    admission: str = "all"
    min_score: float | None = None
    adapter: str | None = "default"

    @property
    def corpora(self) -> tuple[str, ...]:
        return (self.corpus,) if isinstance(self.corpus, str) else self.corpus


def build_replica_app(opts: ReplicaOptions) -> FastAPI:
    """One replica's app: `server.build` over the corpora opened memory → Redis, refreshed between requests."""
    from fastapi import Request
    from starlette.concurrency import run_in_threadpool

    from rag_promptcache.rag.corpora import open_corpora
    from rag_promptcache.server import build

    corpora = open_corpora(opts.corpora, redis_url=opts.redis_url, dtype=opts.dtype, disk_tier=not opts.redis_url,
                           adapter=opts.adapter)
    app, _, _ = build(corpora, k=opts.k, max_batch=opts.max_batch, max_queue=opts.max_queue, api_key=opts.api_key,
                      prefill_chunk=opts.prefill_chunk, admission=opts.admission, min_score=opts.min_score)
    name = _replica_name()

    @app.middleware("http")
    async def refresh_between_requests(request: Request, call_next):
        for corpus in corpora:
            await run_in_threadpool(corpus.refresh)
        response = await call_next(request)
        response.headers["x-replica"] = name
        return response

    return app


def _replica_name() -> str:
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.unique_id
    except RuntimeError:  # built outside a replica (tests of the builder)
        return "local"


def _require():
    try:
        import ray
        from ray import serve
    except ImportError as e:  # a user's setup, not a bug: the CLI's exit 1 with this line
        raise ValueError(f"{INSTALL_HINT} ({e.name or e} is missing)") from e
    return ray, serve


def probe(address: str, timeout_s: float = 3.0) -> None:
    """ValueError naming the cause when `address` (host:port or ray://host:port) takes no connection."""
    if address == "auto":
        return  # ray.init finds the local cluster's file, or fails at once
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r} is not HOST:PORT, ray://HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"cannot reach the Ray cluster at {address!r}: {e.strerror or e}; start one with "
                         "`ray start --head`, or leave out --ray-address to start a local one") from e


def parse_autoscale(text: str) -> tuple[int, int]:
    """"MIN:MAX" (--autoscale) → (MIN, MAX), 1 <= MIN <= MAX; else a ValueError naming the rule."""
    low, sep, high = text.partition(":")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit():
        raise ValueError(f"--autoscale {text!r} is not MIN:MAX (two whole numbers, e.g. 1:4)")
    return check_autoscale((int(low), int(high)))


def check_autoscale(bounds: tuple[int, int]) -> tuple[int, int]:
    low, high = bounds
    if low < 1:
        raise ValueError(f"--autoscale {low}:{high}: MIN must be at least 1 (a replica loads its model before "
                         "it answers, so none at all would make the first request wait for that)")
    if low > high:
        raise ValueError(f"--autoscale {low}:{high}: MIN must be at most MAX")
    return bounds


def deployment_options(opts: ReplicaOptions, replicas: int, autoscale: tuple[int, int] | None,
                       cpus_per_replica: float) -> dict[str, object]:
    """`serve.deployment`'s options: a fixed count, or Ray Serve's autoscaler between autoscale's bounds."""
    if autoscale is None:
        if replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {replicas}")
        scale: dict[str, object] = {"num_replicas": replicas}
    else:
        low, high = check_autoscale(autoscale)
        scale = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                        "target_ongoing_requests": opts.max_batch}}
    return scale | {"name": DEPLOYMENT, "max_ongoing_requests": 2 * opts.max_batch,
                    "ray_actor_options": {"num_cpus": cpus_per_replica}}


def serve_ray(corpus: str | Path | list[Path], *, replicas: int = 2, autoscale: tuple[int, int] | None = None,
              ray_address: str | None = None, host: str = "127.0.0.1", port: int = 8000,
              cpus_per_replica: float = 1.0, opts: ReplicaOptions | None = None,
              log: Callable[[str], None] = print, ready: threading.Event | None = None,
              stop: threading.Event | None = None) -> None:
    """Deploy `replicas` replicas, or `autoscale` = (min, max) under Ray Serve's autoscaler, and block
    until SIGTERM, Ctrl-C or `stop`; then delete the deployment (and stop the cluster if it was started here)."""
    paths = [Path(corpus)] if isinstance(corpus, (str, Path)) else [Path(c) for c in corpus]
    opts = opts or ReplicaOptions(tuple(str(p.resolve()) for p in paths))
    options = deployment_options(opts, replicas, autoscale, cpus_per_replica)
    ray, serve = _require()
    from rag_promptcache.rag import Corpus, corpus_store
    from rag_promptcache.rag.distributed import RayOptions, connect
    from rag_promptcache.rag.layout import find_corpora

    for path in find_corpora(paths):  # a wrong path or a foreign corpus fails here, in a line, before Ray starts
        Corpus.open(path).close()
    if ray_address is not None:
        probe(ray_address)
    # the driver's environment decides the Redis tier, not each node's: replicas get the URL itself
    opts = dataclasses.replace(opts, redis_url=corpus_store.redis_url(opts.redis_url) or "")
    most = autoscale[1] if autoscale else replicas
    started = connect(ray, RayOptions(address=ray_address, workers=most, cpus_per_worker=cpus_per_replica))
    try:
        # ignored by a Serve instance already running
        serve.start(http_options={"host": host, "port": port},
                    controller_options={"runtime_env": {"env_vars": controller_env(os.environ)}})
        deployment = serve.deployment(serve.ingress(lambda: build_replica_app(opts))(type(DEPLOYMENT, (), {})),
                                      **options)
        serve.run(deployment.bind(), name=APP_NAME, route_prefix="/")
        count = f"{autoscale[0]} to {autoscale[1]} autoscaled" if autoscale else str(replicas)
        log(f"serving {', '.join(opts.corpora)} on {count} Ray Serve replica(s) at http://{host}:{port}/ "
            f"and http://{host}:{port}/v1 (cluster {ray_address or 'started here'})")
        _wait(stop or threading.Event(), ready)
    finally:
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        finally:
            if started:
                ray.shutdown()


def controller_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What Serve's controller (and the proxies, which inherit its environment) runs with: our proxy callback and
    readiness timeout, where the user's environment does not set its own."""
    ours = {PROXY_CALLBACK_ENV: f"{__name__}.proxy_middlewares", **PROXY_READY_ENV}
    return {name: value for name, value in ours.items() if name not in environ}


def _wait(stop: threading.Event, ready: threading.Event | None) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready.set()
    while not stop.wait(0.5):
        pass


def proxy_middlewares() -> list[Middleware]:
    """What Ray Serve's proxies wrap themselves in (named by PROXY_CALLBACK_ENV)."""
    from starlette.middleware import Middleware

    return [Middleware(EndCutResponses)]


class EndCutResponses:
    """ASGI middleware for Ray Serve's proxy: a response its replica stopped sending (the replica died)
    ends with an OpenAI error instead of a cut connection: an error event and `[DONE]` when it is a
    stream whose headers are sent, a 500 with an OpenAI error body when nothing was sent yet. A client
    that hung up (the proxy is cancelled) gets nothing."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "done": False, "stream": False}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers", ())).get(b"content-type", b"")
                state.update(started=True, stream=kind.startswith(b"text/event-stream"))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["done"] = True
            await send(message)

        await self.app(scope, receive, watch)
        if state["done"] or (state["started"] and not state["stream"]):
            return  # finished, or a plain body cut mid-way: no way to say more in it
        # responses.error's shape, written here: importing it would load the engine into every proxy
        body = json.dumps({"error": {"message": CUT_MESSAGE, "type": "server_error", "param": None,
                                     "code": "replica_stopped"}})
        if not state["started"]:
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await send({"type": "http.response.body", "body": f"data: {body}\n\ndata: [DONE]\n\n".encode()})
