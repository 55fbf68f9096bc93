"""The single-request decode loop, gpt-fast style: one forward per step over the request's own cache.

    state.advance(prefilled.logits[None])       # the first token, from the prefill
    for piece in decode(model, cache, state):   # then one forward per step until the state finishes
        ...

What to feed and what to keep is the request's `DecodeState` (engine/decoding/state.py), the same one the
batcher drives; this loop only runs the forward (engine/compute/runner.py) and crops the cache where a
prompt lookup draft was rejected. A cache with sliding-window layers cannot be cropped exactly, so it
gets no drafts (`can_crop`).

Out of scope: planning and prefill (engine/planning/plan.py, engine/planning/prefill.py), batching (engine/batching/batcher.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from rag_promptcache.engine.kv.assemble import ReservedLayer
from rag_promptcache.engine.compute.runner import forward_logits
from rag_promptcache.engine.decoding.state import DecodeState


def decode(model: PreTrainedModel, cache: DynamicCache, state: DecodeState, *,
           lock: AbstractContextManager[object] | None = None) -> Iterator[str]:
    """Run `state` to its finish over `cache` (holding the prompt and the answer's tokens but the
    last) → its text pieces as they come. `lock` is held around each forward, never across a yield
    to the caller. The caller may stop early; it owns (and releases) the cache."""
    device = model.device
    while not state.finished:
        fed = state.next_input(draft=can_crop(cache))
        ids = torch.tensor([fed], device=device)  # [1, 1 + draft]
        positions = torch.arange(state.position, state.position + len(fed), device=device)[None]
        with lock if lock is not None else nullcontext():
            rows = forward_logits(model, ids, positions, cache, keep=len(fed))  # [1 + draft, V]
        step = state.advance(rows)
        if step.num_rejected:  # the draft's rejected rest: drop its KV
            cache.crop(-step.num_rejected)
        yield from step.pieces


def can_crop(cache: DynamicCache) -> bool:
    """Whether dropping a cache's last tokens restores it exactly (not so for sliding windows)."""
    return all(type(layer) in (DynamicLayer, ReservedLayer) for layer in cache.layers)
