"""How fast a tier delivers, measured in this process: round-trip latency, bandwidth and decode time
as moving averages, and the load-time estimate the planner weighs against recomputing a module.

A tier that crosses a link (Redis) owns a `LinkMeter` and feeds it every call: small calls (`contains`)
are latency samples; a fetch of an entry is a bandwidth sample once the latency is taken out; decoding
is timed apart, per token, since the codec's cost does not depend on the link. `Link` is what the
meter reports. Pure bookkeeping: no torch, no I/O.

A call on a fast link is shorter than a coarse clock's step, and measures zero or one step. So the
meter sums consecutive samples of each kind until they span at least `timing.MIN_STEPS` steps of the
clock's resolution (measured once per process) and only then takes their mean as one sample of the
moving average. On a fine clock that is every sample; on a clock of 50 ms steps a loopback link stays
unmeasured (no estimate: the planner loads) until its calls add up to a second, and a slow link, the
one worth measuring, is measured at once.

Out of scope: choosing between loading and recomputing (the engine's planner does, with its own
recompute costs), and probing a link that no request has used yet (no samples: no estimate).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from rag_promptcache.timing import MIN_STEPS, process_resolution

ALPHA = 0.2  # weight of the newest sample in each moving average
MIN_TRANSFER_S = 1e-6
ROUND_TRIP_EVERY = 16  # fetches between latency samples a tier takes on its own (a ping)


@dataclass(frozen=True, slots=True)
class Link:
    """A tier's measured link: None where nothing has been measured yet."""

    latency_s: float | None
    bytes_per_s: float | None
    bytes_per_token: float | None
    decode_s_per_token: float | None
    num_samples: int  # calls timed, whether or not they have added up to an estimate yet

    def load_s(self, num_tokens: int) -> float | None:
        """Seconds to fetch and decode an entry of `num_tokens` tokens; None until a fetch was measured."""
        if None in (self.latency_s, self.bytes_per_s, self.bytes_per_token, self.decode_s_per_token):
            return None
        return self.latency_s + num_tokens * (self.bytes_per_token / self.bytes_per_s + self.decode_s_per_token)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass(slots=True)
class _Pending:
    """Samples of one kind summed until they span enough of the clock: seconds, the amount they moved
    (calls, bytes or tokens) and how many calls."""

    seconds: float = 0.0
    amount: float = 0.0
    num_calls: int = 0

    def add(self, seconds: float, amount: float, min_span_s: float) -> bool:
        """Add one sample; whether the sum now spans `min_span_s` (then the caller takes it and clears)."""
        self.seconds, self.amount, self.num_calls = self.seconds + seconds, self.amount + amount, self.num_calls + 1
        return self.seconds >= min_span_s and self.amount > 0

    def clear(self) -> None:
        self.seconds, self.amount, self.num_calls = 0.0, 0.0, 0


class LinkMeter:
    """`resolution_s`: the clock's step; by default measured once per process (timing.process_resolution)."""

    def __init__(self, resolution_s: float | None = None) -> None:
        self._lock = threading.Lock()
        self._min_span_s = MIN_STEPS * (process_resolution() if resolution_s is None else resolution_s)
        self._latency: float | None = None
        self._bandwidth: float | None = None
        self._per_token: float | None = None
        self._decode: float | None = None
        self._round_trips, self._transfers, self._decodes = _Pending(), _Pending(), _Pending()
        self._num_samples = 0
        self._since_round_trip = 0

    def wants_round_trip(self) -> bool:
        """Whether the tier should time a call that moves no data before its next fetch: a whole
        entry in one reply holds latency and transfer together, and the split needs the latency."""
        with self._lock:
            first = self._latency is None and not self._round_trips.num_calls
            return first or self._since_round_trip >= ROUND_TRIP_EVERY

    def round_trip(self, seconds: float) -> None:
        """A call that moves (almost) no data: its time is the latency."""
        with self._lock:
            self._num_samples += 1
            self._since_round_trip = 0
            p = self._round_trips
            if p.add(seconds, 1, self._min_span_s):
                self._latency = _ewma(self._latency, p.seconds / p.amount)
                p.clear()

    def fetch(self, num_bytes: int, num_tokens: int, seconds: float) -> None:
        """An entry of `num_bytes` for `num_tokens` tokens arrived in `seconds` (latency included)."""
        with self._lock:
            self._num_samples += 1
            self._since_round_trip += 1
            if num_tokens:
                self._per_token = _ewma(self._per_token, num_bytes / num_tokens)
            p = self._transfers
            if p.add(seconds, num_bytes, self._min_span_s):
                # an entry that crosses in about one round trip leaves the difference to noise: credit at
                # least half the calls to the transfer, so a jittery latency cannot claim a boundless bandwidth
                latency = (self._latency or 0.0) * p.num_calls
                transfer = max(p.seconds - latency, p.seconds / 2, MIN_TRANSFER_S)
                self._bandwidth = _ewma(self._bandwidth, p.amount / transfer)
                p.clear()

    def decoded(self, num_tokens: int, seconds: float) -> None:
        if num_tokens:
            with self._lock:
                p = self._decodes
                if p.add(seconds, num_tokens, self._min_span_s):
                    self._decode = _ewma(self._decode, p.seconds / p.amount)
                    p.clear()

    def link(self) -> Link:
        with self._lock:
            decode = self._decode
            if decode is None and self._decodes.amount:
                # decodes too quick to span the clock yet (a codec that only reinterprets the bytes):
                # their mean so far, zero included, rather than no link at all
                decode = self._decodes.seconds / self._decodes.amount
            return Link(self._latency, self._bandwidth, self._per_token, decode, self._num_samples)
