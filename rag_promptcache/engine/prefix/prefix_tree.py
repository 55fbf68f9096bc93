"""A radix tree over token keys: the longest prefix of a new request that an earlier request computed.

After sglang's `radix_cache.py`, bookkeeping only (no torch): each edge holds a run of keys (one per
token) and an opaque payload for that run, which the engine supplies (engine/prefix/prefix_cache.py: the KV of
the run's tokens) and the tree never looks into. One tree per `namespace` (an opaque hashable: what
produced the KV, e.g. the model fingerprint and encoding mode), so different models never share a node.

- `match(namespace, keys)` → `Match`: the longest cached prefix, as the payloads along its path (the last
  one possibly used only in part). `lock=True` (or `lock(handle)`) holds a reference on the path while a
  request uses it; locked nodes are never evicted. `release(handle)` drops it.
- `insert(namespace, keys, payload, num_bytes, start=)`: store `payload`, the data of `keys[start:]`,
  below the path of `keys[:start]` (which the caller holds locked). The part of it the tree already
  holds is cut off and dropped; a run that ends inside an edge splits that edge (`split(payload, at)`,
  the one operation on payloads the tree asks for).
- Memory is bounded by `max_bytes`: after an insert (or a release) the tree evicts unlocked leaves,
  lowest `policy.priority(node)` first (least recently used by default), until it fits. A leaf's parent
  may become a leaf in turn, so a long unused branch goes from its tip to its fork.

Keys are token ids in the simplest use; the engine uses one label per token that also says how the
token's KV was produced (engine/prefix/prefix_cache.py), since equal token ids alone do not make equal KV.

Out of scope: the payloads' contents and copying them (engine/prefix/prefix_cache.py), deciding which prefix a
request may reuse (the engine's plan), persistence across processes.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from rag_promptcache.store.eviction import make_policy

P = TypeVar("P")


class Node(Generic[P]):
    """One edge of the tree and the node it leads to: `keys` (a run of tokens) and their `payload`."""

    __slots__ = ("keys", "payload", "num_bytes", "children", "parent", "num_refs", "last_used", "num_hits", "id")

    def __init__(self, keys: tuple[Hashable, ...], payload: P | None, num_bytes: int, parent: Node[P] | None,
                 last_used: float, id: int) -> None:
        self.keys = keys
        self.payload = payload
        self.num_bytes = num_bytes
        self.children: dict[Hashable, Node[P]] = {}  # first key of the child's run -> child
        self.parent = parent
        self.num_refs = 0  # requests using this node or one below it
        self.last_used = last_used
        self.num_hits = 0
        self.id = id  # creation order: the last tie-break, so eviction orders are deterministic

    @property
    def num_tokens(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"Node(id={self.id}, tokens={len(self.keys)}, refs={self.num_refs}, last_used={self.last_used})"


class Policy(Protocol):
    def priority(self, node: Node) -> float: ...


class LRUPolicy:
    """Least recently used (matched or inserted) goes first."""

    def priority(self, node: Node) -> float:
        return node.last_used


POLICIES: dict[str, type[LRUPolicy]] = {"lru": LRUPolicy}


@dataclass(frozen=True, slots=True)
class Match(Generic[P]):
    """The longest cached prefix of the keys asked for: `num_tokens` of them, held by `spans` in order.

    `spans`: (payload, tokens of it used); every payload but the last is used whole. `handle`: the node
    the match ends in (None when nothing matched), for `lock` / `release`.
    """

    num_tokens: int
    spans: tuple[tuple[P, int], ...]
    handle: Node[P] | None


@dataclass(frozen=True, slots=True)
class TreeStats:
    num_nodes: int
    num_tokens: int
    num_bytes: int
    max_bytes: int
    num_locked: int  # nodes in use by a running request
    num_queries: int
    num_hits: int  # matches of at least one token
    num_tokens_reused: int
    num_tokens_inserted: int
    num_evictions: int  # nodes evicted
    num_bytes_evicted: int


def _split_sequence(payload, at: int):
    return payload[:at], payload[at:]


class PrefixTree(Generic[P]):
    """`split(payload, at) -> (head, tail)`: the payload of the first `at` tokens and of the rest (by
    default slicing, for payloads that are sequences). `clock` stamps uses; a counter by default, so
    eviction orders are exact in tests."""

    def __init__(
        self,
        max_bytes: int,
        *,
        policy: str | Policy = "lru",
        split: Callable[[P, int], tuple[P, P]] = _split_sequence,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be a whole number of bytes >= 0 (0 keeps nothing), got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.policy = make_policy(policy, POLICIES, "prefix-tree eviction")
        self._split_payload = split
        counter = itertools.count(1)
        self._clock = clock or (lambda: float(next(counter)))
        self._ids = itertools.count(1)
        self._roots: dict[Hashable, Node[P]] = {}
        self._lock = threading.Lock()
        self.num_bytes = 0
        self.num_tokens = 0
        self.num_nodes = 0
        self.num_queries = 0
        self.num_hits = 0
        self.num_tokens_reused = 0
        self.num_tokens_inserted = 0
        self.num_evictions = 0
        self.num_bytes_evicted = 0

    # -- public --------------------------------------------------------------------------------

    def match(self, namespace: Hashable, keys: Sequence[Hashable], *, lock: bool = False) -> Match[P]:
        """The longest prefix of `keys` the tree holds under `namespace`; `lock=True` locks it at once
        (no eviction can come between the match and the lock); the caller then owes a `release`."""
        with self._lock:
            self.num_queries += 1
            node = self._roots.get(namespace)
            spans: list[tuple[P, int]] = []
            i = 0
            now = self._clock()
            while node is not None and i < len(keys):
                child = node.children.get(keys[i])
                if child is None:
                    break
                n = _common(child.keys, keys, i)
                child.last_used = now
                child.num_hits += 1
                spans.append((child.payload, n))
                i += n
                node = child
                if n < len(child.keys):
                    break
            if i == 0:
                return Match(0, (), None)
            self.num_hits += 1
            self.num_tokens_reused += i
            if lock:
                self._lock_path(node)
            return Match(i, tuple(spans), node)

    def num_held(self, namespace: Hashable, keys: Sequence[Hashable]) -> int:
        """How many of `keys`, from the start, the tree holds; unlike `match`, no use is recorded."""
        with self._lock:
            node, i = self._roots.get(namespace), 0
            while node is not None and i < len(keys):
                child = node.children.get(keys[i])
                if child is None:
                    break
                n = _common(child.keys, keys, i)
                i += n
                node = child if n == len(child.keys) else None
            return i

    def insert(self, namespace: Hashable, keys: Sequence[Hashable], payload: P, num_bytes: int, *,
               start: int = 0) -> int:
        """Store `payload` (`num_bytes`), the data of `keys[start:]`, after the path of `keys[:start]`.
        → the number of tokens newly stored: 0 when the tree holds them all already, when the path of
        `keys[:start]` is gone (evicted: the caller did not lock it), or when they do not fit `max_bytes`
        (alone, or beside what running requests hold locked)."""
        if not 0 <= start <= len(keys):
            raise ValueError(f"start must be within the keys (0 .. {len(keys)}), got {start}")
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
        keys = tuple(keys)
        with self._lock:
            root = self._roots.get(namespace)
            if root is None:
                if start > 0:
                    return 0
                root = self._roots[namespace] = Node((), None, 0, None, self._clock(), next(self._ids))
            node, i = root, 0
            now = self._clock()
            while i < len(keys):
                child = node.children.get(keys[i])
                if child is None:
                    break
                n = _common(child.keys, keys, i)
                if n < len(child.keys):
                    child = self._split(child, n)
                child.last_used = now
                node, i = child, i + n
            if i < start:
                self._drop_empty_root(namespace)
                return 0
            if i == len(keys):
                return 0
            num_new = len(keys) - i
            if i > start:  # the tree has part of the payload's run already: keep only the rest
                total = len(keys) - start
                payload = self._split_payload(payload, i - start)[1]
                num_bytes -= num_bytes * (i - start) // total
            if num_bytes > self.max_bytes:
                self._drop_empty_root(namespace)
                return 0
            leaf = Node(keys[i:], payload, num_bytes, node, now, next(self._ids))
            node.children[keys[i]] = leaf
            self.num_nodes += 1
            self.num_tokens += num_new
            self.num_bytes += num_bytes
            self.num_tokens_inserted += num_new
            self._evict_to(self.max_bytes)
            return num_new if leaf.parent is not None else 0  # evicted at once: all else is locked

    def lock(self, handle: Node[P] | None) -> None:
        """Hold `handle`'s path (the node and every node above it) against eviction. None: nothing."""
        if handle is not None:
            with self._lock:
                self._lock_path(handle)

    def release(self, handle: Node[P] | None) -> None:
        """Drop one `lock` of `handle`'s path; then evict down to `max_bytes` if the tree is above it."""
        if handle is None:
            return
        with self._lock:
            if handle.num_refs <= 0:
                raise ValueError(f"release of {handle!r}, which is not locked: every release needs a lock first")
            node: Node[P] | None = handle
            while node is not None:
                node.num_refs -= 1
                assert node.num_refs >= 0, f"{node=}"
                node = node.parent
            self._evict_to(self.max_bytes)

    def evict(self, max_bytes: int = 0) -> list[tuple[Hashable, ...]]:
        """Evict unlocked leaves until at most `max_bytes` remain (or only locked paths do) → the runs of
        keys evicted, in eviction order."""
        with self._lock:
            return self._evict_to(max_bytes)

    def stats(self) -> TreeStats:
        with self._lock:
            locked = sum(1 for root in self._roots.values() for n in _walk(root) if n.num_refs > 0)
            return TreeStats(self.num_nodes, self.num_tokens, self.num_bytes, self.max_bytes, locked,
                             self.num_queries, self.num_hits, self.num_tokens_reused, self.num_tokens_inserted,
                             self.num_evictions, self.num_bytes_evicted)

    # -- internals (all under self._lock) --------------------------------------------------------

    def _lock_path(self, node: Node[P]) -> None:
        n: Node[P] | None = node
        while n is not None:
            n.num_refs += 1
            n = n.parent

    def _split(self, child: Node[P], at: int) -> Node[P]:
        """Cut `child`'s run after `at` keys: a new node takes the head and becomes its parent → the head.
        `child` keeps its identity (a handle to it still ends where it ended) and its locks, which the
        head inherits since every lock below passes through it."""
        assert 0 < at < len(child.keys), f"{at=} {len(child.keys)=}"
        parent = child.parent
        assert parent is not None, f"{child=} is a root"
        head_payload, tail_payload = self._split_payload(child.payload, at)
        head_bytes = child.num_bytes * at // len(child.keys)
        head = Node(child.keys[:at], head_payload, head_bytes, parent, child.last_used, next(self._ids))
        head.num_refs = child.num_refs
        head.num_hits = child.num_hits
        parent.children[child.keys[0]] = head
        child.keys, child.payload = child.keys[at:], tail_payload
        child.num_bytes -= head_bytes
        child.parent = head
        head.children[child.keys[0]] = child
        self.num_nodes += 1
        return head

    def _evict_to(self, max_bytes: int) -> list[tuple[Hashable, ...]]:
        evicted: list[tuple[Hashable, ...]] = []
        if self.num_bytes <= max_bytes:
            return evicted
        # ties: least recently used, then oldest; ids are unique, so nodes themselves are never compared
        order = lambda n: (self.policy.priority(n), n.last_used, n.id, n)  # noqa: E731
        heap = [order(n) for root in self._roots.values() for n in _walk(root) if _evictable(n)]
        heapq.heapify(heap)
        while self.num_bytes > max_bytes and heap:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            assert parent is not None and parent.children.get(node.keys[0]) is node, f"{node=}"
            del parent.children[node.keys[0]]
            node.parent = None
            self.num_nodes -= 1
            self.num_tokens -= len(node.keys)
            self.num_bytes -= node.num_bytes
            self.num_evictions += 1
            self.num_bytes_evicted += node.num_bytes
            evicted.append(node.keys)
            if _evictable(parent):
                heapq.heappush(heap, order(parent))
        for namespace in [ns for ns, root in self._roots.items() if not root.children]:
            del self._roots[namespace]
        return evicted

    def _drop_empty_root(self, namespace: Hashable) -> None:
        root = self._roots.get(namespace)
        if root is not None and not root.children:
            del self._roots[namespace]


def _common(run: tuple[Hashable, ...], keys: Sequence[Hashable], at: int) -> int:
    """How many keys of `run` equal `keys[at:]`, from the start."""
    n = 0
    for a, b in zip(run, keys[at : at + len(run)]):
        if a != b:
            break
        n += 1
    return n


def _evictable(node: Node) -> bool:
    return node.parent is not None and not node.children and node.num_refs == 0


def _walk(root: Node):
    stack = [root]
    while stack:
        node = stack.pop()
        if node.parent is not None:
            yield node
        stack.extend(node.children.values())
