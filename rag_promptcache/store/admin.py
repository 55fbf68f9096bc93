"""What the CLI calls to inspect and manage a store: describe, verify, evict_to.

Plain functions over any tier (TieredStore is walked tier by tier). They return plain dicts and
records so the CLI only formats. Out of scope: argument parsing and printing (the CLI's job).
"""

from __future__ import annotations

from .base import Store, StoreStats, VerifyReport
from .tiered import TieredStore


def _stats_dict(stats: StoreStats) -> dict[str, float | int]:
    return {
        "num_entries": stats.num_entries,
        "num_bytes": stats.num_bytes,
        "num_tokens": stats.num_tokens,
        "num_hits": stats.num_hits,
        "num_misses": stats.num_misses,
        "num_errors": stats.num_errors,
        "num_write_errors": stats.num_write_errors,
        "hit_rate": stats.hit_rate,
        "bytes_per_token": stats.bytes_per_token,
    }


def describe(store: Store) -> dict[str, object]:
    """Size, entry count, hit rate and bytes per token; per tier for a TieredStore."""
    out: dict[str, object] = {"kind": type(store).__name__, **_stats_dict(store.stats())}
    for attr in ("codec", "max_bytes", "root", "url", "prefix", "write"):
        if hasattr(store, attr):
            value = getattr(store, attr)
            out[attr] = value if isinstance(value, int | float | str | None) else str(value)
    if hasattr(store, "corrupt_entries"):
        out["corrupt"] = store.corrupt_entries()
    if isinstance(store, TieredStore):
        out["tiers"] = [describe(tier) for tier in store.tiers]
    return out


def _leaves(store: Store) -> list[Store]:
    return [leaf for tier in store.tiers for leaf in _leaves(tier)] if isinstance(store, TieredStore) else [store]


def verify(store: Store) -> VerifyReport:
    """Check every persisted entry's header and checksum, removing the bad ones.

    Tiers with nothing to verify (memory, null) are skipped: they hold what was put, in process.
    """
    num_checked, bad, earlier = 0, [], []
    for tier in _leaves(store):
        check = getattr(tier, "verify", None)
        if check is not None:
            report = check()
            num_checked += report.num_checked
            bad += report.bad_keys
            earlier += report.found_earlier
    return VerifyReport(num_checked, tuple(bad), tuple(earlier))


def evict_to(store: Store, num_bytes: int) -> list[str]:
    """Evict from every budgeted tier until each holds at most `num_bytes`; returns evicted keys.

    Raises ValueError if no tier can evict (Redis evicts by its own `maxmemory` policy).
    """
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}")
    tiers = [t for t in _leaves(store) if hasattr(t, "evict_to")]
    if not tiers:
        raise ValueError(f"{type(store).__name__} cannot evict; evict_to works on memory and disk tiers")
    return [key for tier in tiers for key in tier.evict_to(num_bytes)]
