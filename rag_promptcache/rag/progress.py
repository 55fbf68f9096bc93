"""Progress of an ingest, in tokens against the estimate made before it: a tqdm bar with an ETA on a
terminal; elsewhere (a log file, a pipe, a CI job) one plain line every `interval_s` seconds with the
same count and ETA, so a long ingest says where it is without drawing a bar into a log.

Bookkeeping over a clock, printing only; what is counted is the ingestor's (rag/ingestor.py). Not
here: the estimate itself (`ingest.count_tokens`).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import IO

INTERVAL_ENV = "RAG_PROMPTCACHE_PROGRESS_S"  # seconds between progress lines where output is not a terminal
DEFAULT_INTERVAL_S = 30.0


def duration(seconds: float) -> str:
    """1:02:03, 4m05s, 7s: how long, as a person reads it."""
    s = max(0, round(seconds))
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def interval_s() -> float:
    """The line interval: $RAG_PROMPTCACHE_PROGRESS_S, else `DEFAULT_INTERVAL_S`."""
    value = os.environ.get(INTERVAL_ENV)
    if value is None or not value.strip():
        return DEFAULT_INTERVAL_S
    try:
        seconds = float(value)
    except ValueError as e:
        raise ValueError(f"${INTERVAL_ENV} is {value!r}; valid: seconds between progress lines, e.g. 30") from e
    if seconds <= 0:
        raise ValueError(f"${INTERVAL_ENV} is {value!r}; valid: a positive number of seconds")
    return seconds


class Lines:
    """Progress as a line every `interval` seconds: "ingest: 3,072 of ~13,041 tokens (24%), 12 modules,
    1m05s so far, about 3m27s left"."""

    def __init__(self, total: int, *, desc: str = "ingest", interval: float | None = None, file: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.clock = total, desc, clock
        self.interval = interval_s() if interval is None else interval
        self.file = file
        self.started = self.shown = clock()
        self.n = 0
        self.num_modules = 0

    def update(self, num_tokens: int, num_modules: int = 0) -> None:
        self.n += num_tokens
        self.num_modules += num_modules
        now = self.clock()
        if now - self.shown >= self.interval:
            self.shown = now
            print(self.line(now - self.started), file=self.file or sys.stderr, flush=True)

    def line(self, elapsed: float) -> str:
        left = ""
        if self.total and self.n:
            rest = max(0.0, elapsed * (self.total - self.n) / self.n)
            left = f", about {duration(rest)} left" if self.n < self.total else ", finishing"
        of = f" of ~{self.total:,} tokens ({min(self.n / self.total, 1.0):.0%})" if self.total else " tokens"
        return f"{self.desc}: {self.n:,}{of}, {self.num_modules:,} modules, {duration(elapsed)} so far{left}"

    def close(self) -> None:
        pass


class Bar:
    """The terminal's bar: tqdm over tokens, with its rate and ETA, and the modules so far."""

    def __init__(self, total: int, *, desc: str = "ingest", file: IO[str] | None = None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total or None, unit=" tokens", unit_scale=True, desc=desc, dynamic_ncols=True, file=file)
        self.num_modules = 0

    def update(self, num_tokens: int, num_modules: int = 0) -> None:
        self.num_modules += num_modules
        if self.bar.total is not None and self.bar.n + num_tokens > self.bar.total:
            self.bar.total = self.bar.n + num_tokens  # the estimate ran low: the bar ends full, not past it
        self.bar.set_postfix_str(f"{self.num_modules:,} modules", refresh=False)
        self.bar.update(num_tokens)

    def close(self) -> None:
        self.bar.close()


class Silent:
    def update(self, num_tokens: int, num_modules: int = 0) -> None: ...
    def close(self) -> None: ...


def progress(shown: bool | None, total: int, *, desc: str = "ingest") -> Bar | Lines | Silent:
    """`shown` True: the bar; False: nothing; None: the bar on a terminal (stderr), lines elsewhere."""
    if shown is False:
        return Silent()
    if shown or sys.stderr.isatty():
        return Bar(total, desc=desc)
    return Lines(total, desc=desc)
