"""Engine and corpus calls the core does not offer publicly yet (see each CORE GAP); to move to core."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from collections.abc import AsyncIterator
from typing import Any


def info(result: Any) -> dict[str, Any]:
    if result is None:
        return {}
    names = ("finish_reason", "ttft_s", "total_s", "prompt_tokens", "cached_tokens", "computed_tokens",
             "hit_modules", "missed_modules", "recomputed_modules")
    return {n: getattr(result, n) for n in names}


def register(corpus: Any) -> str:
    """CORE GAP (as in the LangChain adapter): `Corpus` has no public way to give the engine its schema."""
    if corpus._registered != corpus.table.generation:
        corpus.engine.add_schema(corpus.schema)
        corpus._registered = corpus.table.generation
    return corpus.manifest.name


async def pieces(stream: Any) -> AsyncIterator[str]:
    """A sync engine `Stream` → async text pieces; `stream.result` is set at the end.

    CORE GAP: `PromptCache.astream` yields text only, never the `Result`; and it steps the stream
    with `asyncio.to_thread`, so steps land on different threads, where the generator's
    `torch.inference_mode()` (thread-local) is not active: the KV cache update then raises. Here
    every step of one stream runs on one dedicated thread."""
    done = object()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1) as thread:
        while (piece := await loop.run_in_executor(thread, next, stream, done)) is not done:
            yield piece
