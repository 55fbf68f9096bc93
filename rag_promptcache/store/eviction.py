"""Eviction bookkeeping: which entries a byte-budgeted tier drops first.

Pure Python on keys and sizes, no torch, so it is tested with exact expected orders. A policy is one
object with one method, `priority(entry)`: the lowest priority is evicted first, ties broken by
least recent use, then by key (so the order is deterministic).

Recency is a sequence, never a clock: each use takes the index's next number (`stamp`), so two uses
never tie, however coarse the machine's clock. A tier shared by processes keeps the sequence beside
its entries and loads it back (`load`, `seq`) under its own lock, so the numbers of every process
compare.

Out of scope: holding the data itself (the tier does), and locking (the tier holds its lock around
every call here).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar


@dataclass(slots=True)
class Entry:
    key: str
    num_bytes: int
    num_tokens: int
    last_used: int  # the index's sequence number at the entry's last use (or its write)
    num_hits: int = 0
    inflation: float = 0.0  # the index's `inflation` at the entry's last use (greedy-dual aging)


class Policy(Protocol):
    def priority(self, entry: Entry) -> float: ...


class LRUPolicy:
    """Least recently used goes first."""

    def priority(self, entry: Entry) -> float:
        return entry.last_used


class CostAwarePolicy:
    """Greedy-dual-size-frequency (GDSF; RAGCache, Jin et al. 2024, for document KV): keep what is
    expensive to recompute per byte held and often used, and let what has not been used for long age out.

        priority = L + (1 + hits) × cost / bytes,   cost = tokens × 1024 (recompute is about linear in
        tokens for module-sized prefills, so tokens stand in for seconds)

    L is the index's `inflation` when the entry was last used: it rises to the priority of each entry
    evicted, so an entry's frequency only protects it while it keeps being used. Within one model and
    codec, cost/bytes is about constant and this is LFU with dynamic aging; across codecs it keeps compact
    (int8) entries longer. RAGCache's prefix-aware cost (a document's KV depends on those before it) does
    not apply: a module's KV here is encoded alone. Measured against LRU on the sustained workload in
    docs/stores.md ("Eviction").
    """

    def priority(self, entry: Entry) -> float:
        return entry.inflation + (1 + entry.num_hits) * entry.num_tokens * 1024 / max(entry.num_bytes, 1)


POLICIES: dict[str, type[LRUPolicy] | type[CostAwarePolicy]] = {"lru": LRUPolicy, "cost": CostAwarePolicy}
P = TypeVar("P")


def make_policy(policy: str | P, policies: Mapping[str, Callable[[], P]] = POLICIES, what: str = "eviction") -> P:
    """`policy` itself, or the policy of that name in `policies` (the store's by default; the prefix
    tree passes its own). An unknown name is a ValueError listing the valid ones."""
    if not isinstance(policy, str):
        return policy
    if policy not in policies:
        raise ValueError(f"unknown {what} policy {policy!r}; valid policies: {', '.join(policies)}")
    return policies[policy]()


class BudgetIndex:
    """Entries of one tier with their sizes; says what to evict to stay within `max_bytes`.

    `seq` is the last sequence number handed out (`stamp`); `inflation` the greedy-dual aging value (the
    highest priority evicted so far, which each use records in its entry). A tier shared between processes
    saves both with the entries and sets them back when it reloads them.
    """

    def __init__(self, max_bytes: int | None = None, policy: str | Policy = "lru", seq: int = 0,
                 inflation: float = 0.0) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
        self.max_bytes = max_bytes
        self.policy = make_policy(policy)
        self.seq = seq
        self.inflation = inflation
        self.entries: dict[str, Entry] = {}
        self.num_bytes = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def stamp(self) -> int:
        """The next sequence number: later than every use this index has seen."""
        self.seq += 1
        return self.seq

    def fits(self, num_bytes: int) -> bool:
        return self.max_bytes is None or num_bytes <= self.max_bytes

    def add(
        self,
        key: str,
        num_bytes: int,
        num_tokens: int,
        last_used: int | None = None,
        num_hits: int = 0,
    ) -> list[Entry]:
        """Add (or replace) an entry; return the entries evicted to make room, already removed.

        An entry larger than the whole budget is not kept: it comes back as the only victim.
        """
        self.remove(key)
        entry = Entry(key, num_bytes, num_tokens, self.stamp() if last_used is None else last_used, num_hits,
                      self.inflation)
        self.seq = max(self.seq, entry.last_used)
        if not self.fits(num_bytes):
            return [entry]
        victims = self.evict_to(self.max_bytes - num_bytes) if self.max_bytes is not None else []
        entry.inflation = self.inflation  # after this eviction's aging, as a use now would see it
        self.entries[key] = entry
        self.num_bytes += num_bytes
        self.num_tokens += num_tokens
        return victims

    def load(self, entry: Entry) -> None:
        """Insert a known entry (from a saved index) without evicting anything."""
        self.remove(entry.key)
        self.seq = max(self.seq, entry.last_used)
        self.entries[entry.key] = entry
        self.num_bytes += entry.num_bytes
        self.num_tokens += entry.num_tokens

    def touch(self, key: str) -> bool:
        """Record a hit. Returns whether the key is known."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        entry.last_used = self.stamp()
        entry.num_hits += 1
        entry.inflation = self.inflation
        return True

    def remove(self, key: str) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
            self.num_tokens -= entry.num_tokens
        return entry

    def victims(self, max_bytes: int) -> list[Entry]:
        """The entries to drop, in eviction order, so that at most `max_bytes` remain (not removed)."""
        excess = self.num_bytes - max_bytes
        if excess <= 0:
            return []
        order = sorted(self.entries.values(), key=lambda e: (self.policy.priority(e), e.last_used, e.key))
        out = []
        for entry in order:
            if excess <= 0:
                break
            out.append(entry)
            excess -= entry.num_bytes
        return out

    def evict_to(self, max_bytes: int) -> list[Entry]:
        """Remove and return the entries to drop so that at most `max_bytes` remain; the aging value rises
        to the highest priority dropped."""
        victims = self.victims(max_bytes)
        for victim in victims:
            self.remove(victim.key)
            self.inflation = max(self.inflation, self.policy.priority(victim))
        return victims
