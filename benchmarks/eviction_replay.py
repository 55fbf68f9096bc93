"""Eviction policies compared on a recorded workload: the module accesses of a sustained run replayed
through the tiers' own bookkeeping (`store.eviction.BudgetIndex`), once per policy.

Which modules a question imports does not depend on what the store holds (retrieval decides), so one
run's access trace serves every policy: what differs is only which accesses hit. The replay follows
`TieredStore` with writes through: a get asks the first tier, then the second (a hit there is
promoted into the first); a miss is encoded and written to both. It counts module tokens served from
a tier, per window of questions, exactly as the store's bookkeeping would decide; it does not time
anything (a hit's cost is the run's to measure).

Not here: the run that records the trace (benchmarks/sustained_large.py), the tiers themselves.
"""

from __future__ import annotations

from collections.abc import Sequence

from rag_promptcache.store.eviction import POLICIES, BudgetIndex

Access = tuple[str, int, int]  # (store key, bytes at rest, tokens)


def replay(trace: Sequence[Sequence[Access]], budgets: Sequence[int | None], policy: str,
           every: int = 100, skip: int = 0) -> dict[str, object]:
    """`trace`: per question, the modules it imported. `budgets`: bytes per tier, fastest first. Returns
    the share of module tokens served from the store per window of `every` questions after the first
    `skip` (the warm-up, replayed but not counted), and over all of them."""
    tiers = [BudgetIndex(b, policy) for b in budgets]
    windows: list[float] = []
    served = total = w_served = w_total = 0
    for q, modules in enumerate(trace):
        for key, num_bytes, num_tokens in modules:
            hit = _get(tiers, key, num_bytes, num_tokens)
            if q >= skip:
                w_served += num_tokens if hit else 0
                w_total += num_tokens
        if q >= skip and (q - skip + 1) % every == 0:
            windows.append(w_served / w_total if w_total else 0.0)
            served, total, w_served, w_total = served + w_served, total + w_total, 0, 0
    served, total = served + w_served, total + w_total
    return {"policy": policy, "windows": windows, "served_share": served / total if total else 0.0}


def _get(tiers: list[BudgetIndex], key: str, num_bytes: int, num_tokens: int) -> bool:
    for i, tier in enumerate(tiers):
        if key in tier:
            tier.touch(key)
            for upper in tiers[:i]:
                upper.add(key, num_bytes, num_tokens)
            return True
    for tier in tiers:
        tier.add(key, num_bytes, num_tokens)
    return False


def compare(trace: Sequence[Sequence[Access]], budgets: Sequence[int | None], every: int = 100,
            skip: int = 0) -> dict[str, dict[str, object]]:
    """`replay` under every policy the store knows."""
    return {name: replay(trace, budgets, name, every, skip) for name in POLICIES}
