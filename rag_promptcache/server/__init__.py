"""An OpenAI-compatible HTTP server over one corpus: `rag-promptcache serve --corpus C`.

Needs the `server` extra (fastapi, uvicorn, sse-starlette, prometheus-client). `serve` binds the port first (a port in
use fails in a second, before the model loads), opens the corpus, starts the engine's
continuous-batching scheduler and runs uvicorn on that socket; `create_app` builds the ASGI app alone.

SIGTERM (or Ctrl-C) shuts down gracefully: no new connections, requests in flight (streams included)
get `shutdown_timeout` seconds to finish and are cancelled after it, each step said on stderr; SIGTERM
then exits 0 (uvicorn alone re-raises the signal: exit 143), Ctrl-C 130.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rag_promptcache.engine.batching.batcher import Batcher
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.chat import CorpusChat

INSTALL_HINT = "the server needs its extra: pip install 'rag-promptcache[server]'"


def build(corpus: str | Path | Corpus, *, k: int = 4, max_batch: int = 8, max_queue: int = 64,
          redis_url: str | None = None, dtype: str | None = None, api_key: str | None = None,
          prefill_chunk: int | None = None, admission: str = "all", min_score: float | None = None,
          adapter: str | None = "default") -> tuple[FastAPI, Batcher, CorpusChat]:
    """Open `corpus` (a path, or a corpus already opened), load its model, start its scheduler, and return
    (app, scheduler, chat). Close the scheduler and the corpus when done."""
    try:
        from rag_promptcache.server.app import create_app
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{INSTALL_HINT} ({e.name} is missing)") from e
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.chat import CorpusChat

    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    c = corpus if isinstance(corpus, Corpus) else Corpus.open(corpus, redis_url=redis_url, dtype=dtype, adapter=adapter)
    try:
        chat = CorpusChat(c)  # loads the model and compiles the corpus schema before the first request
    except BaseException:
        c.close()
        raise
    try:
        batcher = c.engine.scheduler(max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                                     admission=admission)
    except BaseException:
        c.close()
        raise
    c.warm_when_idle()  # idle time refills what questions keep coming back to (rag/lazy.py)
    model_id = c.path.resolve().name
    try:
        return create_app(chat, batcher, model_id=model_id, k=k, api_key=api_key, min_score=min_score), batcher, chat
    except BaseException:
        batcher.close()
        c.close()
        raise


def serve(corpus: str | Path, *, host: str = "127.0.0.1", port: int = 8000, k: int = 4, max_batch: int = 8,
          max_queue: int = 64, redis_url: str | None = None, dtype: str | None = None, api_key: str | None = None,
          prefill_chunk: int | None = None, admission: str = "all", shutdown_timeout: float = 30,
          min_score: float | None = None,
          log_level: str = "info", log_format: str = "text", adapter: str | None = "default",
          log: Callable[[str], None] = print,
          say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
    """Run until SIGTERM or Ctrl-C; `log` gets the start-up line, `say` (stderr) the shutdown steps."""
    try:
        import uvicorn
        from sse_starlette.sse import AppStatus

        from rag_promptcache.server.access_log import configure as configure_logging
        from rag_promptcache.server.lifecycle import GracefulServer, bind
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{INSTALL_HINT} ({e.name} is missing)") from e

    from rag_promptcache.rag import Corpus

    # the quick checks first, each one line: the corpus (no model loaded yet), then the port
    opened = Corpus.open(corpus, redis_url=redis_url, dtype=dtype, adapter=adapter)
    try:
        sock = bind(host, port)
    except BaseException:
        opened.close()
        raise
    # on stderr: one access line per request, and a 500's request id with its traceback
    configure_logging(log_level, log_format)
    try:
        app, batcher, chat = build(opened, k=k, max_batch=max_batch, max_queue=max_queue, api_key=api_key,
                                   prefill_chunk=prefill_chunk, admission=admission, min_score=min_score)
    except BaseException:
        sock.close()
        raise
    model_id = chat.corpus.path.resolve().name
    bound = sock.getsockname()[1]
    tuned = chat.corpus.engine.adapter_name
    log(f"serving corpus {chat.corpus.path} as model {model_id!r} ({chat.corpus.engine.model_name}"
        f"{f' with adapter {tuned}' if tuned else ''}, "
        f"k={k}, max batch {max_batch}, queue {max_queue}{', API key required' if api_key else ''}) "
        f"on http://{host}:{bound}/ (chat page) and http://{host}:{bound}/v1")
    # sse-starlette would end every open stream at the first signal; let them finish within the timeout instead
    AppStatus.disable_automatic_graceful_drain()
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout)
    server = GracefulServer(config, batcher=batcher, say=say)
    try:
        server.run(sockets=[sock])
    finally:
        if server.signals:
            say(f"cancelled the requests still open after {shutdown_timeout:g} s" if server.cancelled
                else "all requests finished")
        batcher.close()
        chat.corpus.close()
        sock.close()
    if server.signals:
        say("server stopped")
    if signal.SIGINT in server.signals:
        raise KeyboardInterrupt
