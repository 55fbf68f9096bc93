"""Engine and corpus calls the core does not offer publicly yet (see each CORE GAP); to move to core."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def info(result: Any) -> dict[str, Any]:
    if result is None:
        return {}
    names = ("finish_reason", "ttft_s", "total_s", "prompt_tokens", "cached_tokens", "computed_tokens",
             "hit_modules", "missed_modules", "recomputed_modules")
    return {n: getattr(result, n) for n in names}


def register(corpus: Any) -> str:
    """Make sure the engine holds the corpus schema (`Corpus.prepare`: once per table change); → its name."""
    corpus.prepare()
    return corpus.manifest.name


async def pieces(stream: Any) -> AsyncIterator[str]:
    """A sync engine `Stream` → async text pieces; `stream.result` is set at the end.

    CORE GAP: `PromptCache.astream` yields text only, never the `Result`. One thread per stream
    (the engine once kept `inference_mode` thread-locally across steps; harmless now)."""
    done = object()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1) as thread:
        while (piece := await loop.run_in_executor(thread, next, stream, done)) is not done:
            yield piece
