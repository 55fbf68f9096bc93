"""Prefill: a `Plan` → its assembled, relocated KV cache with the new tokens run against it, and the
logits of the answer's first token.

One forward over every new token of the prompt (the question, glue text, what recovery recomputes),
against the modules' KV assembled into a cache with room reserved for the answer (engine/assemble.py).
Callers own the cache afterwards: the engine's decode loop decodes into it, the batcher copies it
into a row of its batch cache; both `release` it when done.

Out of scope: planning (engine/plan.py), decoding (engine/decode.py, engine/batcher.py). Chunked
prefill (issue 24: the batcher interleaving a long prefill with decode steps) would split
`Prefilled`'s one forward into several here.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from rag_promptcache.engine.assemble import assemble
from rag_promptcache.engine.plan import Plan
from rag_promptcache.engine.prefix_cache import PrefixUse
from rag_promptcache.engine.runner import forward_last
from rag_promptcache.model.positions import KVGeometry, Relocator


@dataclass(frozen=True, slots=True)
class Prefilled:
    cache: DynamicCache  # the prompt's KV, with room for `room` more tokens
    logits: torch.Tensor  # [V] fp32: the next-token logits after the prompt
    next_position: int  # of the answer's first token
    # what the prefix cache gave and holds locked for this request: its owner ends it (engine.keep_prefix)
    prefix: PrefixUse | None = None


@torch.inference_mode()
def prefill(model: PreTrainedModel, plan: Plan, relocator: Relocator, geometry: KVGeometry, room: int = 0, *,
            lock: AbstractContextManager[object] | None = None) -> Prefilled:
    """Assemble `plan`'s KV with `room` tokens to spare and run its new tokens. `lock` (the engine's
    `model_lock`) is held around the forward only: assembly copies KV and runs no model."""
    asm = assemble(plan.pieces, plan.kvs, relocator, model.config, geometry, model.device, model.dtype, extra=room)
    with lock if lock is not None else nullcontext():
        logits = forward_last(model, asm.new_ids, asm.new_positions, asm.cache, asm.mask)
    return Prefilled(asm.cache, logits, plan.next_position)
