"""Timing that a coarse clock cannot fool.

On some virtual machines `time.perf_counter()` advances in steps of 4 to 50 ms for minutes at a time: a
short span measures zero, and events within one step share a stamp. So every measurement here knows
the clock's step:
- `resolution()` measures the step now (the bench does when it starts, and records it);
- `repeat(fn, min_span_s)` calls `fn` until the calls together span at least `min_span_s` (the bench
  asks for `MIN_STEPS` steps) and divides, so a short call is timed as a mean over many;
- `ratio(a, b)` is None, never a ZeroDivisionError, where the duration `b` measured zero, and
  `describe` writes that None as `BELOW_RESOLUTION`.

No module of the package imports anything here but this file: the store's link meter, the engine's
cost model and the bench all use it. Out of scope on purpose: ordering events. Nothing orders events
by a clock; a sequence does (store/eviction.py, the prefix tree).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

MIN_STEPS = 20  # a timed span covers at least this many steps of the clock
BELOW_RESOLUTION = "below the clock's resolution"
_CHANGES = 5  # clock changes `resolution` looks at
_MAX_READS = 10_000_000  # a clock that never moves (a fake one) stops the search here

T = TypeVar("T")


def resolution(clock: Callable[[], float] = time.perf_counter, changes: int = _CHANGES) -> float:
    """The clock's step as seen now, in seconds: the median of `changes` consecutive changes of its value
    (the median, so a spin preempted once does not pass for a coarse clock). Spins for about `changes`
    steps: microseconds on a fine clock, a quarter of a second on a clock of 50 ms steps. A clock that
    did not move within `_MAX_READS` reads reports infinity."""
    steps: list[float] = []
    last = clock()
    for _ in range(_MAX_READS):
        now = clock()
        if now != last:
            steps.append(now - last)
            last = now
            if len(steps) == changes:
                return float(statistics.median(steps))
    return float("inf")


@functools.cache
def process_resolution() -> float:
    """`resolution()` of `time.perf_counter`, measured once per process (for code that times on a hot path)."""
    return resolution()


@dataclass(frozen=True, slots=True)
class Timed(Generic[T]):
    seconds: float  # per call: the span over the number of calls
    calls: int
    span_s: float  # the whole span, as the clock measured it
    result: T  # the last call's


def repeat(fn: Callable[[], T], min_span_s: float, clock: Callable[[], float] = time.perf_counter,
           before: Callable[[], object] = lambda: None) -> Timed[T]:
    """Call `fn` (once at least) until the calls together span at least `min_span_s`. `before` runs
    before every read of the clock (a CUDA synchronize), so the span holds the work it timed."""
    calls = 0
    before()
    t0 = clock()
    while True:
        out = fn()
        calls += 1
        before()
        span = clock() - t0
        if span >= min_span_s:
            return Timed(span / calls, calls, span, out)


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den; None where the duration `den` measured zero (below the clock's resolution) or is not
    a number, or where either is None (a rate that was itself not measurable)."""
    return None if num is None or den is None or not den > 0 else num / den


def describe(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    """`value` formatted, or `BELOW_RESOLUTION` for a ratio that could not be measured."""
    return BELOW_RESOLUTION if value is None else f"{value:{spec}}{unit}"
