"""A byte budget for one prefix's entries in Redis, kept by every process that writes under it.

Redis' own `maxmemory` bounds the whole server, with sampled LRU over every key of every user; a
corpus's budget is its own entries' bytes, under its own policy (eviction.py), whichever replica
writes. Keys, beside the store's `{prefix}:index` (key -> "bytes,tokens[,hits]"):
- `{prefix}:rank`: a sorted set, each entry's priority (`Policy.priority`) as of its last use; the
  lowest goes first. Recency breaks ties: a use's sequence number, scaled far below any priority
  step, is added to its score.
- `{prefix}:budget`: a hash: `bytes` (the entries' total, kept exact by two Lua scripts that update
  it with the index in one step), `seq` (uses, numbered), `inflation` (greedy-dual aging: the highest
  priority evicted).
- `{prefix}:evict`: a lock (redis-py's) around making room, so two writers never evict for each other.

Room is made before a write and checked again after it (two writers may each have made room for
themselves): the total may pass the budget by what concurrent writers add at once, never more, and
never for longer than their writes. A hit's count is read and written back without a transaction:
two replicas hitting one entry at once may count it once. Entries written before the budget existed
are counted when it first runs (`bytes` is missing then).

Out of scope: connection failures (the store catches them around every call here), TTLs (an expired
entry stays counted until a get finds it gone and the store removes it).
"""

from __future__ import annotations

from collections.abc import Callable

from .eviction import Entry, Policy, make_policy

# Adds a key's bytes to the total, less what an entry it replaces counted: KEYS index, budget; ARGV key, row, bytes
_ADD = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local delta = tonumber(ARGV[3])
if old then delta = delta - tonumber(string.match(old, '^(%d+)')) end
return redis.call('HINCRBY', KEYS[2], 'bytes', delta)
"""
# Removes a key from the index and the ranking, and its bytes from the total: KEYS index, budget, rank; ARGV key
_REMOVE = """
redis.call('ZREM', KEYS[3], ARGV[1])
local old = redis.call('HGET', KEYS[1], ARGV[1])
if not old then return redis.call('HINCRBY', KEYS[2], 'bytes', 0) end
redis.call('HDEL', KEYS[1], ARGV[1])
return redis.call('HINCRBY', KEYS[2], 'bytes', -tonumber(string.match(old, '^(%d+)')))
"""
TIE_SCALE = 1e-12  # a use's sequence number times this breaks priority ties by recency


def parse_row(row: bytes | str) -> tuple[int, int, int]:
    """An index row "bytes,tokens[,hits]" -> (bytes, tokens, hits)."""
    parts = (row.decode() if isinstance(row, bytes) else row).split(",")
    return int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) > 2 else 0


class RedisBudget:
    def __init__(self, client, prefix: str, max_bytes: int, policy: str | Policy = "lru") -> None:
        if max_bytes < 1:
            raise ValueError(f"a Redis budget must be at least 1 byte, got {max_bytes}")
        self.client, self.max_bytes = client, max_bytes
        self.policy = make_policy(policy)
        self.index, self.rank = f"{prefix}:index", f"{prefix}:rank"
        self.meta, self.lock_key = f"{prefix}:budget", f"{prefix}:evict"
        self._add = client.register_script(_ADD)
        self._remove = client.register_script(_REMOVE)

    def fits(self, num_bytes: int) -> bool:
        return num_bytes <= self.max_bytes

    def total(self) -> int:
        """The entries' bytes as the budget counts them (counted from the index the first time)."""
        raw = self.client.hget(self.meta, "bytes")
        if raw is not None:
            return int(raw)
        total = sum(parse_row(row)[0] for row in self.client.hvals(self.index))
        self.client.hsetnx(self.meta, "bytes", total)
        return int(self.client.hget(self.meta, "bytes"))

    def make_room(self, key: str, num_bytes: int, delete: Callable[[str], bool]) -> list[str]:
        """Evict, lowest priority first, until `key` fits at `num_bytes` (0: until the total does; what
        `key` already holds is replaced, not added); returns the keys evicted."""
        with self.client.lock(self.lock_key, timeout=30, blocking_timeout=10):
            row = self.client.hget(self.index, key) if num_bytes else None
            num_bytes -= parse_row(row)[0] if row is not None else 0
            evicted: list[str] = []
            while self.total() + num_bytes > self.max_bytes:
                lowest = self.client.zrange(self.rank, 0, 15, withscores=True)
                if not lowest:
                    break  # nothing ranked: entries from before the budget, or another writer's in flight
                for member, score in lowest:
                    key = member.decode()
                    delete(key)
                    evicted.append(key)
                    self.client.hset(self.meta, "inflation", max(self.inflation(), score))
                    if self.total() + num_bytes <= self.max_bytes:
                        break
            return evicted

    def inflation(self) -> float:
        return float(self.client.hget(self.meta, "inflation") or 0.0)

    def added(self, key: str, num_bytes: int, num_tokens: int) -> None:
        """A write of `key` landed: counted in the total and ranked as a fresh entry."""
        self._add(keys=[self.index, self.meta], args=[key, f"{num_bytes},{num_tokens},0", num_bytes])
        self._rank(Entry(key, num_bytes, num_tokens, 0))

    def used(self, key: str) -> None:
        """A hit on `key`: one more hit, ranked again."""
        row = self.client.hget(self.index, key)
        if row is None:
            return
        num_bytes, num_tokens, hits = parse_row(row)
        self.client.hset(self.index, key, f"{num_bytes},{num_tokens},{hits + 1}")
        self._rank(Entry(key, num_bytes, num_tokens, 0, hits + 1))

    def removed(self, key: str) -> None:
        self._remove(keys=[self.index, self.meta, self.rank], args=[key])

    def _rank(self, entry: Entry) -> None:
        seq = int(self.client.hincrby(self.meta, "seq", 1))
        entry.last_used, entry.inflation = seq, self.inflation()
        self.client.zadd(self.rank, {entry.key: self.policy.priority(entry) + seq * TIE_SCALE})
