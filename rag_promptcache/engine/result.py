"""The records the engine hands out: `Result`, `Comparison`, `EncodeReport`, and the `Stream` iterator."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "eos"]
Path = Literal["cached", "full", "none"]  # "none": no model ran (`fixed_stream`)


@dataclass(frozen=True, slots=True)
class Result:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    ttft_s: float  # from the call to the first sampled token: parse, plan, fetch, encode misses, prefill
    total_s: float
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was not computed here: from the store or the prefix cache
    computed_tokens: int  # prompt tokens computed in this request (new text, misses, recomputed modules)
    hit_modules: tuple[str, ...]
    # not in the store: computed in this request's prefill and queued for the background encoder (the
    # deferred ones), or encoded from their text, used and written back (`misses="encode"`)
    missed_modules: tuple[str, ...]
    recomputed_modules: tuple[str, ...]  # stored but not reusable at this position (absolute positions)
    # forwards after the prefill: one per token after the first, fewer where prompt lookup drafts were accepted
    num_decode_forwards: int = 0
    # of cached_tokens, those reused from an earlier request's KV (the prefix cache: engine/prefix/prefix_cache.py)
    num_prefix_tokens: int = 0
    # "full": a plain prefill of every prompt token ran (use_cache=False, a prompt that imports no module,
    # or the planner's fallback found it faster than the cached plan, engine/planning/costmodel.py); cached_tokens is
    # then 0. "none": the text was not generated (`fixed_stream`)
    path: Path = "cached"
    # the tuned adapter merged into the model's weights (its name, model/adapter.py); None: the base model
    adapter: str | None = None
    # of missed_modules, those this request did not wait for: computed in its prefill (or by the full prefill
    # the cost model chose), their store entries left to the background encoder
    deferred_modules: tuple[str, ...] = ()

    @property
    def served(self) -> str:
        """How the modules were served: "store" (every module from the store or the prefix cache), "deferred"
        (some missed, computed here without waiting for their encoding), "waited" (some missed and were
        encoded before the answer), "none" (no module)."""
        if self.missed_modules:
            return "waited" if set(self.missed_modules) - set(self.deferred_modules) else "deferred"
        return "store" if self.hit_modules or self.cached_tokens else "none"

    @property
    def num_generated(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True, slots=True)
class Comparison:
    """Next-token logits from the cached assembly against a full prefill of the same token sequence."""

    max_abs_logit_diff: float
    top1_match: bool
    kl: float  # KL(full || cached) of the next-token distributions
    cached_top1: int
    full_top1: int
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class EncodeReport:
    num_modules: int  # encoded and stored by this call
    num_tokens: int
    num_skipped: int  # already in the store
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0


class Stream(Iterator[str]):
    """Iterate for text pieces; `.result` holds the `Result` once the stream is exhausted."""

    def __init__(self, gen: Generator[str, None, Result]) -> None:
        self._gen = gen
        self.result: Result | None = None

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        if self.result is not None:
            raise StopIteration
        try:
            return next(self._gen)
        except StopIteration as stop:
            self.result = stop.value
            raise

    def close(self) -> None:
        self._gen.close()

    def consume(self) -> Result:
        for _ in self:
            pass
        assert self.result is not None
        return self.result


def fixed_stream(text: str) -> Stream:
    """A `Stream` of text no model generated (a caller's fixed reply, such as "not found"): one piece,
    then a `Result` with no tokens, finish "stop" and path "none"."""
    t0 = time.perf_counter()

    def gen() -> Generator[str, None, Result]:
        yield text
        elapsed = time.perf_counter() - t0
        return Result(text, (), "stop", elapsed, elapsed, 0, 0, 0, (), (), (), path="none")

    return Stream(gen())


class AsyncStream(AsyncIterator[str]):
    """Async text pieces; `.result` holds the `Result` once exhausted. The model runs in worker
    threads (planning on the first step), so the event loop never blocks."""

    def __init__(self, start: Callable[[], Stream]) -> None:
        self._start = start
        self._stream: Stream | None = None
        self.result: Result | None = None

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> str:
        if self._stream is None:
            self._stream = await asyncio.to_thread(self._start)
        piece = await asyncio.to_thread(next, self._stream, None)
        if piece is None:
            self.result = self._stream.result
            raise StopAsyncIteration
        return piece

    async def consume(self) -> Result:
        async for _ in self:
            pass
        assert self.result is not None
        return self.result
