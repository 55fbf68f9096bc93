"""Prefill: a `Plan` → its assembled, relocated KV cache with the new tokens run against it, and the
logits of the answer's first token.

The new tokens of the prompt (the question, glue text, what recovery recomputes) run against the
modules' KV assembled into a cache with room reserved for the answer (engine/kv/assemble.py). `start`
returns a `Prefilling` that runs them in one forward (`run(model)`: `PromptCache.prefill`) or a chunk at
a time (`run(model, tokens)`): the batcher interleaves those chunks with the decode steps of running
requests, so that a long prefill does not stall their streams (chunked prefill, as vLLM and SGLang
schedule it). A chunk attends to the cache so far (the assembled modules and the chunks before it)
and causally to itself, through the same rows and columns of assembly's mask, so the chunks together
compute what the one forward does (tests/test_chunked_prefill.py compares the logits).

Callers own the cache afterwards: the engine's decode loop decodes into it, the batcher copies it
into a row of its batch cache; both `release` it when done.

Out of scope: planning (engine/planning/plan.py), decoding (engine/decoding/decode.py, engine/batching/batcher.py), when a chunk
runs (engine/batching/batcher.py), several requests' chunks in one forward (engine/batching/batch.py
`mixed_step`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from rag_promptcache.engine.kv.assemble import Assembled, Mask, mask_rows
from rag_promptcache.engine.kv.stream import assemble_for
from rag_promptcache.engine.planning.plan import Plan
from rag_promptcache.engine.prefix.prefix_cache import PrefixUse
from rag_promptcache.engine.compute.runner import forward_last
from rag_promptcache.model.positions import KVGeometry, Relocator

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True, slots=True)
class Prefilled:
    cache: DynamicCache  # the prompt's KV, with room for `room` more tokens
    logits: torch.Tensor  # [V] fp32: the next-token logits after the prompt
    next_position: int  # of the answer's first token
    # what the prefix cache gave this request: its owner ends it (engine.keep_kv)
    prefix: PrefixUse | None = None


# (num_new, num_context, seconds, rows): a forward that ran a prefill's tokens (`Prefilling.__init__`)
OnRan = Callable[[int, int, float, Sequence[int]], None]


@dataclass(frozen=True, slots=True)
class Chunk:
    """The next new tokens of a `Prefilling`, as a forward over its cache takes them."""

    ids: torch.Tensor  # [1, m]
    positions: torch.Tensor  # [1, m]
    mask: Mask | None  # [1, 1, m, cache length + m] additive (per layer type: assemble.py); None: causal
    last: bool  # the prefill's last chunk: its last token's logits are the answer's first


class Prefilling:
    """A prefill under way: the plan's KV assembled, `num_done` of its `num_new` new tokens run so far."""

    def __init__(self, asm: Assembled, next_position: int, prefix: PrefixUse | None = None,
                 on_logits: Callable[[torch.Tensor], None] | None = None,
                 on_ran: OnRan | None = None) -> None:
        """`on_logits`: called with the answer's first logits [V] when the last chunk has run (the
        prefix cache keeps them for a repeat). `on_ran(num_new, num_context, seconds, rows)`: called after
        each forward `run` makes, with its tokens, the tokens they attended to before them and its seconds
        (the engine's cost model follows the machine's pace with it); the batcher calls it too for a
        forward it ran this prefill's chunk in, with the decode rows that forward carried."""
        self.asm = asm
        self.next_position = next_position
        self.prefix = prefix  # what the prefix cache gave (already copied into the cache), or None
        self.on_logits = on_logits
        self.on_ran = on_ran
        self.num_new = asm.new_ids.shape[1]
        self.num_done = 0

    @property
    def repeat(self) -> bool:
        """The prefix cache gave every token and the logits after them: `prefilled()` needs no forward."""
        return self.prefix is not None and self.prefix.repeat

    @property
    def cache(self) -> DynamicCache:
        return self.asm.cache

    @property
    def num_left(self) -> int:
        return self.num_new - self.num_done

    def take(self, tokens: int | None = None) -> Chunk:
        """The next `tokens` new tokens (None: all that are left), counted as done: the caller runs them
        against `cache` (`run`, or the batcher's step that carries a chunk, engine/batching/batch.py)."""
        if tokens is not None and tokens < 1:
            raise ValueError(f"a prefill chunk needs at least 1 token, got {tokens}")
        assert self.num_left > 0, f"{self.num_done=} {self.num_new=}: this prefill is done"
        a = self.num_done
        b = self.num_new if tokens is None else min(self.num_new, a + tokens)
        asm = self.asm
        # mask: [1, 1, N, C + N] over (new tokens) x (cached, then new tokens). The chunk's rows, and the
        # columns of what the cache holds once the chunk is in: the C cached tokens and new tokens 0..b-1,
        # which sit in the cache in that same order (earlier chunks wrote new tokens 0..a-1 after the C)
        mask = mask_rows(asm.mask, a, b, asm.num_cached + b)
        self.num_done = b
        return Chunk(asm.new_ids[:, a:b], asm.new_positions[:, a:b], mask, b == self.num_new)

    def prefilled(self, logits: torch.Tensor | None = None) -> Prefilled:
        """`logits` [V]: the last chunk's last token's (None: a repeat's, kept) → the finished prefill."""
        assert self.num_left == 0, f"{self.num_left=}"
        if logits is None:
            assert self.repeat, "only a repeat's prefill finishes without logits"
            logits = self.prefix.reuse.logits
        elif self.on_logits is not None:
            self.on_logits(logits)
        self.asm.to_sequence_order()  # what decoding's window needs (sliding-window layers only)
        return Prefilled(self.asm.cache, logits, self.next_position, self.prefix)

    @torch.inference_mode()
    def run(self, model: PreTrainedModel, tokens: int | None = None) -> Prefilled | None:
        """Run the next `tokens` new tokens (None: all that are left) in one forward → the `Prefilled`
        once the last one has run, else None; a repeat's at once, with no forward. The caller holds the
        model lock around it."""
        if self.repeat:
            return self.prefilled()
        num_context = self.asm.num_cached + self.num_done
        chunk = self.take(tokens)
        t0 = time.perf_counter()
        logits = forward_last(model, chunk.ids, chunk.positions, self.asm.cache, chunk.mask)
        if self.on_ran is not None:
            if logits.device.type == "cuda":
                torch.cuda.synchronize(logits.device)
            self.on_ran(chunk.ids.shape[1], num_context, time.perf_counter() - t0, ())
        return self.prefilled(logits) if chunk.last else None


def start(model: PreTrainedModel, plan: Plan, relocator: Relocator, geometry: KVGeometry, room: int = 0) -> Prefilling:
    """Assemble `plan`'s KV with `room` tokens to spare (copies KV, runs no model; on a GPU from host memory,
    layer by layer while the forward runs: engine/kv/stream.py) → its new tokens to run."""
    asm = assemble_for(plan.pieces, plan.kvs, relocator, model.config, geometry, model.device, model.dtype, extra=room)
    return Prefilling(asm, plan.next_position)
