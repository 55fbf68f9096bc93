"""How fast a tier delivers, measured in this process: round-trip latency, bandwidth and decode time
as moving averages, and the load-time estimate the planner weighs against recomputing a module.

A tier that crosses a link (Redis) owns a `LinkMeter` and feeds it every call: small calls (`contains`)
are latency samples; a fetch of an entry is a bandwidth sample once the latency is taken out; decoding
is timed apart, per token, since the codec's cost does not depend on the link. `Link` is what the
meter reports. Pure bookkeeping: no torch, no I/O.

Out of scope: choosing between loading and recomputing (the engine's planner does, with its own
recompute costs), and probing a link that no request has used yet (no samples: no estimate).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

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
    num_samples: int

    def load_s(self, num_tokens: int) -> float | None:
        """Seconds to fetch and decode an entry of `num_tokens` tokens; None until a fetch was measured."""
        if None in (self.latency_s, self.bytes_per_s, self.bytes_per_token, self.decode_s_per_token):
            return None
        return self.latency_s + num_tokens * (self.bytes_per_token / self.bytes_per_s + self.decode_s_per_token)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


class LinkMeter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latency: float | None = None
        self._bandwidth: float | None = None
        self._per_token: float | None = None
        self._decode: float | None = None
        self._num_samples = 0
        self._since_round_trip = 0

    def wants_round_trip(self) -> bool:
        """Whether the tier should time a call that moves no data before its next fetch: a whole
        entry in one reply holds latency and transfer together, and the split needs the latency."""
        with self._lock:
            return self._latency is None or self._since_round_trip >= ROUND_TRIP_EVERY

    def round_trip(self, seconds: float) -> None:
        """A call that moves (almost) no data: its time is the latency."""
        with self._lock:
            self._latency = _ewma(self._latency, seconds)
            self._num_samples += 1
            self._since_round_trip = 0

    def fetch(self, num_bytes: int, num_tokens: int, seconds: float) -> None:
        """An entry of `num_bytes` for `num_tokens` tokens arrived in `seconds` (latency included)."""
        with self._lock:
            # an entry that crosses in about one round trip leaves the difference to noise: credit at
            # least half the call to the transfer, so a jittery latency cannot claim a boundless bandwidth
            transfer = max(seconds - (self._latency or 0.0), seconds / 2, MIN_TRANSFER_S)
            self._since_round_trip += 1
            self._bandwidth = _ewma(self._bandwidth, num_bytes / transfer)
            if num_tokens:
                self._per_token = _ewma(self._per_token, num_bytes / num_tokens)
            self._num_samples += 1

    def decoded(self, num_tokens: int, seconds: float) -> None:
        if num_tokens:
            with self._lock:
                self._decode = _ewma(self._decode, seconds / num_tokens)

    def link(self) -> Link:
        with self._lock:
            return Link(self._latency, self._bandwidth, self._per_token, self._decode, self._num_samples)
