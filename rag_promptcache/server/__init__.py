"""An OpenAI-compatible HTTP server over one or more corpora: `rag-promptcache serve --corpus A [--corpus B]`.

Needs the `server` extra (fastapi, uvicorn, sse-starlette, prometheus-client). `serve` binds the port first (a port in
use fails in a second, before a model loads), opens the corpora (corpora on one model share it:
rag/corpora.py), starts one continuous-batching scheduler per loaded model and runs uvicorn on that
socket; a request's `model` names its corpus. `create_app` builds the ASGI app alone.

SIGTERM (or Ctrl-C) shuts down gracefully: no new connections, requests in flight (streams included)
get `shutdown_timeout` seconds to finish and are cancelled after it, each step said on stderr; SIGTERM
then exits 0 (uvicorn alone re-raises the signal: exit 143), Ctrl-C 130.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rag_promptcache.engine.batching.batcher import Batcher
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.chat import CorpusChat

INSTALL_HINT = "the server needs its extra: pip install 'rag-promptcache[server]'"


def build(corpora: str | Path | Corpus | Sequence[str | Path | Corpus], *, k: int = 4, max_batch: int = 8,
          max_queue: int = 64, redis_url: str | None = None, dtype: str | None = None, api_key: str | None = None,
          prefill_chunk: int | None = None, admission: str = "all", min_score: float | None = None,
          adapter: str | None = "default") -> tuple[FastAPI, list[Batcher], list[CorpusChat]]:
    """Open `corpora` (paths of corpora or of folders of them, `rag.corpora.open_corpora`: corpora on one
    model share it; or corpora already opened), load their models, start one scheduler per engine, and
    return (app, schedulers, chats). Close the schedulers, then the corpora (`rag.corpora.close_corpora`)."""
    try:
        from rag_promptcache.server.app import create_app
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{INSTALL_HINT} ({e.name} is missing)") from e
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.chat import CorpusChat
    from rag_promptcache.rag.corpora import close_corpora, open_corpora

    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    given = [corpora] if isinstance(corpora, (str, Path, Corpus)) else list(corpora)
    opened = [c for c in given if isinstance(c, Corpus)]
    if opened and len(opened) != len(given):
        raise ValueError("pass corpora as paths or as opened corpora, not both")
    opened = opened or open_corpora(given, redis_url=redis_url, dtype=dtype, adapter=adapter)
    batchers: dict[int, Batcher] = {}  # one per engine: corpora sharing a model decode in one batch
    try:
        chats = [CorpusChat(c) for c in opened]  # loads the models and compiles the schemas before the first request
        for c in opened:
            if id(c.engine) not in batchers:
                batchers[id(c.engine)] = c.engine.scheduler(max_batch=max_batch, max_queue=max_queue,
                                                            prefill_chunk=prefill_chunk, admission=admission)
        for c in opened:  # idle time refills what each corpus's questions keep coming back to (rag/lazy.py)
            c.warm_when_idle()
        served = [(chat, batchers[id(chat.corpus.engine)], chat.corpus.path.resolve().name) for chat in chats]
        return create_app(served, k=k, api_key=api_key, min_score=min_score), list(batchers.values()), chats
    except BaseException:
        for b in batchers.values():
            b.close()
        close_corpora(opened)
        raise


def serve(corpora: str | Path | Sequence[str | Path], *, host: str = "127.0.0.1", port: int = 8000, k: int = 4,
          max_batch: int = 8, max_queue: int = 64, redis_url: str | None = None, dtype: str | None = None,
          api_key: str | None = None, prefill_chunk: int | None = None, admission: str = "all",
          shutdown_timeout: float = 30, min_score: float | None = None,
          log_level: str = "info", log_format: str = "text", adapter: str | None = "default",
          log: Callable[[str], None] = print,
          say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
    """Run until SIGTERM or Ctrl-C; `log` gets the start-up lines, `say` (stderr) the shutdown steps."""
    try:
        import uvicorn
        from sse_starlette.sse import AppStatus

        from rag_promptcache.server.access_log import configure as configure_logging
        from rag_promptcache.server.lifecycle import GracefulServer, bind
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{INSTALL_HINT} ({e.name} is missing)") from e

    from rag_promptcache.rag.corpora import close_corpora, open_corpora
    from rag_promptcache.rag.layout import find_corpora

    # the quick checks first, each one line: the corpora (no model loaded yet), then the port
    found = find_corpora([corpora] if isinstance(corpora, (str, Path)) else corpora)
    sock = bind(host, port)
    try:
        opened = open_corpora(found, redis_url=redis_url, dtype=dtype, adapter=adapter)
    except BaseException:
        sock.close()
        raise
    # on stderr: one access line per request, and a 500's request id with its traceback
    configure_logging(log_level, log_format)
    try:
        app, batchers, chats = build(opened, k=k, max_batch=max_batch, max_queue=max_queue, api_key=api_key,
                                     prefill_chunk=prefill_chunk, admission=admission, min_score=min_score)
    except BaseException:
        sock.close()
        raise
    bound = sock.getsockname()[1]
    for chat in chats:
        c = chat.corpus
        tuned = c.engine.adapter_name
        log(f"serving corpus {c.path} as model {c.path.resolve().name!r} ({c.engine.model_name}"
            f"{f' with adapter {tuned}' if tuned else ''}, {len(c)} modules)")
    shared = f", {len(chats)} corpora on {len(batchers)} loaded model(s)" if len(chats) > 1 else ""
    log(f"k={k}, max batch {max_batch}, queue {max_queue}{', API key required' if api_key else ''}{shared}: "
        f"http://{host}:{bound}/ (chat page) and http://{host}:{bound}/v1")
    # sse-starlette would end every open stream at the first signal; let them finish within the timeout instead
    AppStatus.disable_automatic_graceful_drain()
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=shutdown_timeout)
    server = GracefulServer(config, batchers=batchers, say=say)
    try:
        server.run(sockets=[sock])
    finally:
        if server.signals:
            say(f"cancelled the requests still open after {shutdown_timeout:g} s" if server.cancelled
                else "all requests finished")
        for b in batchers:
            b.close()
        close_corpora([chat.corpus for chat in chats])
        sock.close()
    if server.signals:
        say("server stopped")
    if signal.SIGINT in server.signals:
        raise KeyboardInterrupt
