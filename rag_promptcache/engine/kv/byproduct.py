"""By-product entries: a missed module's KV kept from the prefill of the question that retrieved it.

A deferred miss (engine/planning/plan.py) is computed in its request's prefill, after the modules
before it in that prompt, as a full prefill computes it. Where the schema asks for it
(`ast.Schema.byproduct`: a corpus ingested with `--byproduct`), that KV becomes the module's entry:
once the answer is done, the module's tokens are copied out of the request's cache, their keys moved
back to the module's own position (`Unit.encode_start`), and the entry goes to the background
encoder's queue ready-made: storing it runs no forward. docs/FIDELITY.md measured such entries ("the
full prefill's KV as a by-product encoding"): read with nothing recomputed they keep the answers on
corpora of look-alike documents, and lose some on unrelated pages of a manual, so a corpus chooses them
and no default does.

`Byproduct` is what a plan records of such a module (where its tokens lie in the prompt); `entries`
makes the entries from a finished request's cache. Only where the cache holds every layer's keys in the
order assembly wrote them and keys can be moved exactly (`supported`); elsewhere the miss is encoded on
its own, as for any other schema.

Out of scope: when the entry is written (engine/planning/background.py), which modules missed (the planner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rag_promptcache.engine.prefix.prefix_cache import cache_slots
from rag_promptcache.engine.prompt.compiler import Piece, Unit
from rag_promptcache.model.positions import KVGeometry, Relocator
from rag_promptcache.store.base import ModuleKV, Store

FULL = "full_attention"


@dataclass(frozen=True, slots=True)
class Byproduct:
    """A missed module whose KV this request computes: the module, where its tokens lie in the prompt
    (`seq`: the index of its first token in the prompt's tokens; `position`: that token's position) and
    where its entry goes."""

    key: str
    unit: Unit
    seq: int
    position: int
    store: Store


def supported(relocator: Relocator, geometry: KVGeometry, end: int) -> bool:
    """Whether a prompt ending at position `end` can leave by-product entries: keys that move exactly
    (rotary below the relocator's exact bound, or no positions) and only full-attention layers (a sliding
    layer's cache is put back in sequence order after the prefill, engine/kv/assemble.py)."""
    bound = relocator.exact_below
    return relocator.relocatable and (bound is None or end < bound) and set(geometry.layer_types) == {FULL}


def located(pieces: Sequence[Piece], units: Sequence[Unit]) -> dict[str, tuple[int, int]]:
    """Each of `units` whose tokens are one whole piece of `pieces` → (seq, position) of its first token."""
    wanted = {u.name: u for u in units}
    out: dict[str, tuple[int, int]] = {}
    seq = 0
    for p in pieces:
        u = wanted.get(p.unit or "")
        if u is not None and p.offset == 0 and p.token_ids == u.token_ids and u.name not in out:
            out[u.name] = (seq, p.position)
        seq += len(p.token_ids)
    return out


@torch.inference_mode()
def entries(byproducts: Sequence[Byproduct], pieces: Sequence[Piece], keys: Sequence[torch.Tensor],
            values: Sequence[torch.Tensor], length: int, relocator: Relocator, fingerprint: str,
            mode: str) -> list[tuple[Byproduct, ModuleKV]]:
    """The entries of `byproducts` from a finished request's cache, given per layer (keys[i], values[i]:
    [H, capacity, D], `length` tokens written) as assembled from `pieces` (the prefill's, prefix spliced
    in): copies, so the cache may be reused at once. A module whose tokens are not where the plan put
    them (a prompt shortened since) is skipped."""
    slots = cache_slots(pieces)
    tokens = [t for p in pieces for t in p.token_ids]
    out = []
    for b in byproducts:
        ids, n = b.unit.token_ids, len(b.unit.token_ids)
        at = slots[b.seq : b.seq + n]
        if tuple(tokens[b.seq : b.seq + n]) != ids or not at or max(at) >= length:
            continue
        index = torch.tensor(at, device=keys[0].device)
        k = torch.stack([layer.index_select(1, index) for layer in keys])  # [L, H, n, D]
        v = torch.stack([layer.index_select(1, index) for layer in values])
        k = relocator.rotate(k, torch.full((n,), b.unit.encode_start - b.position, dtype=torch.long))
        out.append((b, ModuleKV(k.contiguous(), v, b.unit.encode_start, ids, fingerprint, mode)))
    return out
