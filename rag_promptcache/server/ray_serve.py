"""`serve --ray`: the same OpenAI app as `serve`, as a Ray Serve deployment of N replicas.

Each replica is one Ray actor that opens the corpus, loads its own engine (memory tier, then the
shared Redis tier when one is configured: no disk tier, so replicas on one machine do not contend
for one directory) and builds the app with `server.build`; `serve.ingress` takes that builder, so the
routes, streaming, the page and the API key are the app's own. Before each request a replica calls
`Corpus.refresh()`: an `ingest` made meanwhile (by anyone) is seen by the next request, never
half-way through one. Each response names its replica in `x-replica`.

Without `--ray-address` a local cluster is started here and stopped on exit; with one, the address
is probed first, so an unreachable cluster fails in seconds instead of Ray's own minute of retries.
The corpus path must be readable at the same path on every node, with the package installed there.

Not here: autoscaling policy, the shutdown of a replica's open streams (Ray Serve's own).
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from fastapi import FastAPI

INSTALL_HINT = "serve --ray needs Ray Serve: pip install 'rag-promptcache[ray]'"
APP_NAME = "rag-promptcache"


@dataclass(frozen=True, slots=True)
class ReplicaOptions:
    """What every replica is built with (sent to the replicas by value)."""

    corpus: str
    k: int = 4
    max_batch: int = 8
    max_queue: int = 64
    redis_url: str | None = None  # None: $RAG_PROMPTCACHE_REDIS_URL where the deployment starts; "": none
    dtype: str | None = None
    api_key: str | None = None
    prefill_chunk: int | None = None
    min_score: float | None = None
    adapter: str | None = "default"


def build_replica_app(opts: ReplicaOptions) -> FastAPI:
    """One replica's app: `server.build` over a corpus opened memory → Redis, refreshed between requests."""
    from fastapi import Request
    from starlette.concurrency import run_in_threadpool

    from rag_promptcache.rag import Corpus
    from rag_promptcache.server import build

    corpus = Corpus.open(opts.corpus, redis_url=opts.redis_url, dtype=opts.dtype, disk_tier=not opts.redis_url,
                         adapter=opts.adapter)
    app, _, _ = build(corpus, k=opts.k, max_batch=opts.max_batch, max_queue=opts.max_queue, api_key=opts.api_key,
                      prefill_chunk=opts.prefill_chunk, min_score=opts.min_score)
    name = _replica_name()

    @app.middleware("http")
    async def refresh_between_requests(request: Request, call_next):
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


def serve_ray(corpus: str | Path, *, replicas: int = 2, ray_address: str | None = None, host: str = "127.0.0.1",
              port: int = 8000, cpus_per_replica: float = 1.0, opts: ReplicaOptions | None = None,
              log: Callable[[str], None] = print, ready: threading.Event | None = None,
              stop: threading.Event | None = None) -> None:
    """Deploy and block until SIGTERM, Ctrl-C or `stop`; then delete the deployment (and stop the
    cluster if it was started here)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    ray, serve = _require()
    from rag_promptcache.rag import Corpus, corpus_store
    from rag_promptcache.rag.distributed import RayOptions, connect

    Corpus.open(corpus).close()  # a wrong path or a foreign corpus fails here, in a line, before Ray starts
    if ray_address is not None:
        probe(ray_address)
    # the driver's environment decides the Redis tier, not each node's: replicas get the URL itself
    opts = opts or ReplicaOptions(str(Path(corpus).resolve()))
    opts = dataclasses.replace(opts, redis_url=corpus_store.redis_url(opts.redis_url) or "")
    started = connect(ray, RayOptions(address=ray_address, workers=replicas, cpus_per_worker=cpus_per_replica))
    try:
        serve.start(http_options={"host": host, "port": port})
        deployment = serve.deployment(
            serve.ingress(lambda: build_replica_app(opts))(type("PromptCacheReplica", (), {})),
            name="PromptCacheReplica", num_replicas=replicas, ray_actor_options={"num_cpus": cpus_per_replica})
        serve.run(deployment.bind(), name=APP_NAME, route_prefix="/")
        log(f"serving corpus {opts.corpus} on {replicas} Ray Serve replica(s) at http://{host}:{port}/ "
            f"and http://{host}:{port}/v1 (cluster {ray_address or 'started here'})")
        _wait(stop or threading.Event(), ready)
    finally:
        try:
            serve.delete(APP_NAME)
            serve.shutdown()
        finally:
            if started:
                ray.shutdown()


def _wait(stop: threading.Event, ready: threading.Event | None) -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready.set()
    while not stop.wait(0.5):
        pass
