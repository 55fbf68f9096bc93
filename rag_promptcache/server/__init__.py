"""An OpenAI-compatible HTTP server over one corpus: `rag-promptcache serve --corpus C`.

Needs the `server` extra (fastapi, uvicorn, sse-starlette). `serve` opens the corpus, starts the
engine's continuous-batching scheduler and runs uvicorn; `create_app` builds the ASGI app alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from fastapi import FastAPI

    from rag_promptcache.engine.batcher import Batcher
    from rag_promptcache.rag.chat import CorpusChat

INSTALL_HINT = "the server needs its extra: pip install 'rag-promptcache[server]'"


def build(corpus: str | Path, *, k: int = 4, max_batch: int = 8, max_queue: int = 64, redis_url: str | None = None,
          dtype: str | None = None) -> tuple[FastAPI, Batcher, CorpusChat]:
    """Open `corpus`, start its scheduler, and return (app, scheduler, chat). Close the scheduler when done."""
    try:
        from rag_promptcache.server.app import create_app
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"{INSTALL_HINT} ({e.name} is missing)") from e
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.chat import CorpusChat

    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    c = Corpus.open(corpus, redis_url=redis_url, dtype=dtype)
    chat = CorpusChat(c)  # loads the model and compiles the corpus schema before the first request
    batcher = c.engine.scheduler(max_batch=max_batch, max_queue=max_queue)
    model_id = Path(corpus).resolve().name
    return create_app(chat, batcher, model_id=model_id, k=k), batcher, chat


def serve(corpus: str | Path, *, host: str = "127.0.0.1", port: int = 8000, k: int = 4, max_batch: int = 8,
          max_queue: int = 64, redis_url: str | None = None, dtype: str | None = None,
          log: Callable[[str], None] = print) -> None:
    import uvicorn

    app, batcher, chat = build(corpus, k=k, max_batch=max_batch, max_queue=max_queue, redis_url=redis_url, dtype=dtype)
    model_id = Path(corpus).resolve().name
    log(f"serving corpus {chat.corpus.path} as model {model_id!r} ({chat.corpus.engine.model_name}, "
        f"k={k}, max batch {max_batch}, queue {max_queue}) on http://{host}:{port}/v1")
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        batcher.close()
        chat.corpus.close()
