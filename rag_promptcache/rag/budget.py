"""A corpus's store budget, set once: bytes per tier and the eviction policy, recorded in its manifest
and honoured by every process that opens it (ingest, `serve`, the Ray replicas and ingest workers).

`ingest --store-budget memory=512MiB,disk=20GiB,redis=4GiB --eviction cost` (or `Corpus.build(budget=...)`,
`Corpus.set_budget`) sets it; a tier not named keeps its budget. The memory tier's is per process; the
disk tier's is shared by every process on the machine (store/disk.py), Redis' by every replica (store/
redis_budget.py). A budget lowered between runs is held when the store is next opened (the lowest
priority entries go first); one smaller than a module of the corpus is refused, since such a tier
could never hold anything.

Not here: the tiers (store/), opening them (corpus_store.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_promptcache.store.config import parse_size
from rag_promptcache.store.eviction import POLICIES, make_policy

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.records import Manifest

TIERS = ("memory", "disk", "redis")
KV_MODES = ("eager", "lazy")
HEADER_BYTES = 8192  # a stored entry's header (token ids, checksum, metadata), about, at a module's size

DEFAULT_MEMORY_BYTES = 1 << 30
# The default policy for a new corpus: cost-aware (greedy-dual-size-frequency). Replayed on the module
# accesses of the large sustained run (1,000 novel questions over a 2.2M-token lazy corpus), it served more
# of them from the store than LRU at every budget tried: 0.334 against 0.311 at the run's 1/20 of the
# corpus, 0.251 against 0.217 at half of it, equal within 0.005 at 2x and 4x (docs/stores.md, "Eviction").
DEFAULT_POLICY = "cost"


@dataclass(frozen=True, slots=True)
class StoreBudget:
    """Bytes per tier (None: unbounded) and the eviction policy of every tier."""

    memory: int | None = DEFAULT_MEMORY_BYTES
    disk: int | None = None
    redis: int | None = None
    policy: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        make_policy(self.policy)
        for tier in TIERS:
            value = getattr(self, tier)
            if value is not None and value < 1:
                raise ValueError(f"the {tier} budget must be a size of at least 1 byte, or none (unbounded); "
                                 f"got {value}")

    @classmethod
    def of(cls, manifest: object) -> StoreBudget:
        """The budget a manifest records."""
        return cls(manifest.memory_budget, manifest.disk_budget, manifest.redis_budget, manifest.policy)  # type: ignore[attr-defined]

    def manifest_fields(self) -> dict[str, object]:
        return {"memory_budget": self.memory, "disk_budget": self.disk, "redis_budget": self.redis,
                "policy": self.policy}

    def describe(self) -> str:
        return ", ".join(f"{t} {_size(getattr(self, t))}" for t in TIERS) + f"; eviction {self.policy}"

    def total(self, tiers: tuple[str, ...] = TIERS) -> int | None:
        """The bytes the named tiers may hold together (None: one of them is unbounded)."""
        values = [getattr(self, t) for t in tiers]
        return None if any(v is None for v in values) else sum(values)  # type: ignore[arg-type]


def parse(spec: str, base: StoreBudget | None = None, policy: str | None = None) -> StoreBudget:
    """"memory=512MiB,disk=20GiB,redis=none" over `base` (tiers not named keep their budget). A bad tier,
    size or policy is a ValueError naming the valid ones."""
    base = base or StoreBudget()
    values: dict[str, object] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        tier, sep, size = part.partition("=")
        tier = tier.strip().lower()
        if not sep or tier not in TIERS:
            raise ValueError(f"cannot read store budget {part!r}; write TIER=SIZE[,TIER=SIZE] with TIER one of "
                             f"{', '.join(TIERS)} and SIZE like 512MiB, 20GiB or none")
        values[tier] = parse_size(size)
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"unknown eviction policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    return dataclasses.replace(base, **values, **({"policy": policy} if policy else {}))


def check_kv(kv: str | None) -> None:
    if kv is not None and kv not in KV_MODES:
        raise ValueError(f"unknown kv mode {kv!r}; valid modes: {', '.join(KV_MODES)}")


def check_byproduct(byproduct: bool | None, kv: str | None, neighbours: int | None) -> None:
    """A new corpus's `byproduct` (module KV kept from the prefills of the questions that retrieve it, lazily)."""
    if byproduct and kv != "lazy":
        raise ValueError("byproduct (--byproduct) keeps a missed module's KV from the prefill of the question "
                         "that retrieved it; a corpus encoded at ingest has no misses: ingest with --kv lazy")
    if byproduct and neighbours:
        raise ValueError("byproduct (--byproduct) and neighbours (--neighbours) are two ways to encode a module "
                         "after others; choose one")


def module_bytes(engine: PromptCache, num_tokens: int, codec: str) -> int:
    """About what a module of `num_tokens` tokens costs at rest in `codec` for `engine`'s model."""
    from rag_promptcache.store.codecs import bytes_per_token

    g = engine.geometry
    per_token = bytes_per_token(codec, (g.num_layers, g.num_kv_heads, g.head_dim), engine.model.dtype, num_tokens)
    return int(per_token * num_tokens) + HEADER_BYTES


def check_fits(budget: StoreBudget, num_bytes: int, tiers: tuple[str, ...] = TIERS) -> None:
    """Refuse a tier budget smaller than one module of `num_bytes` (the corpus's largest, at rest)."""
    small = [t for t in tiers if (v := getattr(budget, t)) is not None and v < num_bytes]
    if small:
        shown = ", ".join(f"{t} {_size(getattr(budget, t))}" for t in small)
        raise ValueError(f"store budget {shown} is smaller than one module of this corpus (up to {_size(num_bytes)} "
                         f"at rest), so that tier could hold nothing; give it at least {_size(num_bytes)} (a "
                         "useful budget holds the modules questions keep retrieving: docs/stores.md), or none")


def changes(old: StoreBudget, new: StoreBudget) -> list[str]:
    """What differs, for the message a changed budget prints: ["disk 4.0 GiB -> 2.0 GiB", ...]."""
    out = [f"{t} {_size(getattr(old, t))} -> {_size(getattr(new, t))}" for t in TIERS
           if getattr(old, t) != getattr(new, t)]
    if old.policy != new.policy:
        out.append(f"eviction {old.policy} -> {new.policy}")
    return out


def record(manifest: Manifest, budget: StoreBudget | None, kv: str | None,
           engine: Callable[[], PromptCache]) -> tuple[Manifest, list[str]]:
    """`manifest` with `budget` and `kv` (None: keep each), and what changed. A new budget is checked
    against the corpus's largest module (the engine, loaded if need be, knows the KV's size)."""
    check_kv(kv)
    if kv == "eager" and manifest.byproduct:
        raise ValueError("this corpus keeps module KV from the prefills of its questions (byproduct): its KV "
                         "stays lazy; ingest into a new corpus to encode it eagerly")
    old = StoreBudget.of(manifest)
    changed = changes(old, budget) if budget is not None else []
    if changed:
        check_fits(budget, module_bytes(engine(), manifest.max_tokens, manifest.codec))  # type: ignore[arg-type]
    if kv is not None and kv != manifest.kv:
        changed.append(f"kv {manifest.kv} -> {kv}")
    if not changed:
        return manifest, []
    fields = budget.manifest_fields() if budget is not None else {}
    return dataclasses.replace(manifest, **fields, kv=kv or manifest.kv, updated=time.time()), changed


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "unbounded"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"
