"""The single-request decode loop, gpt-fast style: one forward per step over the request's own cache.

    state.advance(prefilled.logits[None])       # the first token, from the prefill
    for piece in decode(model, cache, state):   # then one forward per step until the state finishes
        ...

What to feed and what to keep is the request's `DecodeState` (engine/decoding/state.py), the same one the
batcher drives; this loop only runs the step (engine/compute/graphs.py `step_for`: on CUDA a graph over a
static buffer, else the forward of engine/compute/runner.py) and drops the KV of a rejected prompt lookup
draft. transformers' own cache of sliding-window layers cannot be cropped exactly, so it gets no drafts
(`can_crop`); the engine's reserved cache of them keeps every token, and can.

Out of scope: planning and prefill (engine/planning/plan.py, engine/planning/prefill.py), batching (engine/batching/batcher.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rag_promptcache.engine.kv.assemble import ReservedLayer
from rag_promptcache.engine.compute.graphs import step_for
from rag_promptcache.engine.decoding.state import DecodeState

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def decode(model: PreTrainedModel, cache: DynamicCache, state: DecodeState, *,
           lock: AbstractContextManager[object] | None = None) -> Iterator[str]:
    """Run `state` to its finish over `cache` (holding the prompt and the answer's tokens but the
    last) → its text pieces as they come. `lock` is held around each forward, never across a yield
    to the caller. The caller may stop early; it owns (and releases) the cache."""
    if state.finished:  # the prefill's token was the whole answer: no step to set up
        return
    device = model.device
    lock = lock if lock is not None else nullcontext()
    draft = can_crop(cache)
    with lock:
        run = step_for(model, cache, room=state.sampling.max_new_tokens, width=1 + (state.lookup if draft else 0))
    try:
        while not state.finished:
            fed = state.next_input(draft=draft)
            ids = torch.tensor([fed], device=device)  # [1, 1 + draft]
            positions = torch.arange(state.position, state.position + len(fed), device=device)[None]
            with lock:
                rows = run(ids, positions)  # [1 + draft, V]
            step = state.advance(rows)
            if step.num_rejected:  # the draft's rejected rest: drop its KV
                run.crop(step.num_rejected)
            yield from step.pieces
    finally:  # the answer's KV is in `cache` from here on
        with lock:
            run.close()


def can_crop(cache: DynamicCache) -> bool:
    """Whether dropping a cache's last tokens restores it exactly (not so for transformers' sliding layers)."""
    return all(type(layer) in (DynamicLayer, ReservedLayer) for layer in cache.layers)
