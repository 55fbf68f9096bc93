"""A coarse clock for the whole process, on purpose: `PYTHONPATH=tests/coarse_clock` (see `make test-coarse`).

Python imports `sitecustomize` at start-up when it is on the path, before any test or library code
runs, and every subprocess that inherits PYTHONPATH imports it too. It replaces `time.perf_counter`,
`time.monotonic`, `time.time` and their `_ns` forms with the same clocks rounded down to
`RAG_PROMPTCACHE_CLOCK_STEP_S` seconds (50 ms unless set), as some virtual machines give for minutes at a
time: short spans measure zero, events in one step share a stamp. Code that orders events by a clock,
divides by a duration or asserts a short span was measurable fails under it.

C code (socket timeouts, `Lock.acquire(timeout=)`) keeps the real clock.
"""

from __future__ import annotations

import os
import time

STEP_NS = round(float(os.environ.get("RAG_PROMPTCACHE_CLOCK_STEP_S", "0.05")) * 1e9)


def _coarse(real_ns):
    def ns() -> int:
        return real_ns() // STEP_NS * STEP_NS

    def seconds() -> float:
        return ns() / 1e9

    return ns, seconds


if STEP_NS > 0:
    for _name in ("perf_counter", "monotonic", "time"):
        _ns, _s = _coarse(getattr(time, f"{_name}_ns"))
        for _f, _fname in ((_ns, f"{_name}_ns"), (_s, _name)):
            _f.__name__ = _f.__qualname__ = _fname
            _f.__module__ = "time"  # where tools that name a timer (pytest-benchmark) look it up
        setattr(time, f"{_name}_ns", _ns)
        setattr(time, _name, _s)
