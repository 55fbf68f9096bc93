"""Question-aware token selection for recovery (issue 26): which few cached tokens to recompute.

`question_mass` runs the prompt's new tokens (the question, after the last cached token) over the
assembled cache, modules at their real positions, up to the deepest of the given layers, and returns
how much attention the question's tokens give each cached token there (softmax per head over the
cached keys, summed over heads and question tokens, averaged over the layers). This is the scoring
of ProphetKV / A^3 without their training or fine-grained layer schedule; its cost is the question's
tokens through a few layers, counted in TTFT by whoever times the plan.

`choose` turns the scores into a set of sequence indices under a token budget, in one of three
shapes:
- `tokens`: the top-scored tokens, each with `window` neighbours on both sides (a fact's value is
  usually several tokens);
- `sentences`: whole sentences, the one holding the most question attention first, until the
  budget is spent: sub-module granularity;
- either plus `sinks`: the first tokens of every stale module (EPIC's attention-sink tokens).
The first module when it is exact already (shared_prefix, not moved) and the schema's own text are
never chosen: recomputing them changes nothing.

Out of scope: recomputing some layers of a token only (the single prefill recomputes a token in every
layer), and attention temperature on cached tokens (the fused prefill kernel takes no additive bias).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rag_promptcache.engine.kv.assemble import assemble, release
from rag_promptcache.engine.prompt.compiler import ROOT, Piece
from rag_promptcache.engine.compute.runner import forward_base
from rag_promptcache.model.positions import KVGeometry, Relocator
from rag_promptcache.store.base import ModuleKV

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SHAPES = ("tokens", "sentences")


@dataclass(frozen=True, slots=True)
class Selection:
    """How many cached tokens to recompute and how to pick them."""

    ratio: float  # share of the choosable tokens to recompute (the budget); with `near`, of the near modules'
    layers: tuple[int, ...] = (4, 8, 12)  # where the question's attention is read
    shape: str = "tokens"
    window: int = 1  # tokens: neighbours taken on each side of a chosen token
    sinks: int = 0  # first tokens of every stale module, outside the budget
    near: int = 0  # > 0: choose only inside the `near` stale modules nearest the question
    whole: int = 0  # the `whole` stale modules nearest the question in full, the budget spent elsewhere

    def __post_init__(self) -> None:
        if not 0 <= self.ratio <= 1:
            raise ValueError(f"selection ratio must be in [0, 1], got {self.ratio}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown selection shape {self.shape!r}; valid: {', '.join(SHAPES)}")
        if not self.layers or min(self.layers) < 0:
            raise ValueError(f"selection layers must be non-empty and >= 0, got {self.layers}")
        if min(self.window, self.sinks, self.near, self.whole) < 0:
            raise ValueError(f"window, sinks, near and whole must be >= 0, got {self.window}, {self.sinks}, "
                             f"{self.near}, {self.whole}")


@dataclass(frozen=True, slots=True)
class Stale:
    """The cached tokens that recovery may choose, in sequence order."""

    seq: list[int]  # sequence index of each cached token (cache order = sequence order)
    unit: list[str]  # its module
    choosable: list[bool]  # not the root, not the exact first module
    token_ids: list[int]


def stale_tokens(pieces: Sequence[Piece], kvs: dict[str, ModuleKV]) -> Stale:
    exact = exact_module(pieces, kvs)
    seq, unit, ok, ids = [], [], [], []
    at = 0
    for p in pieces:
        if p.cached:
            n = len(p.token_ids)
            seq.extend(range(at, at + n))
            unit.extend([p.unit] * n)
            ok.extend([p.unit != ROOT and p.unit != exact] * n)
            ids.extend(p.token_ids)
        at += len(p.token_ids)
    return Stale(seq, unit, ok, ids)


@torch.inference_mode()
def question_mass(
    pieces: Sequence[Piece],
    kvs: dict[str, ModuleKV],
    model: PreTrainedModel,
    relocator: Relocator,
    geometry: KVGeometry,
    layers: Sequence[int],
) -> torch.Tensor:
    """[C] fp32: the question's attention on each cached token (cache order), averaged over `layers`."""
    decoder = model.base_model.layers
    deepest = max(layers)
    if deepest >= len(decoder):
        raise ValueError(f"selection layer {deepest} is past the model's {len(decoder)} layers")
    attns = [decoder[i].self_attn for i in layers]
    if any(not hasattr(a, "q_proj") for a in attns):
        raise ValueError(f"question-aware selection reads queries through q_proj, which {type(model).__name__} "
                         "lacks; use last:N or selective:R")
    device = model.device
    asm = assemble(pieces, kvs, relocator, model.config, geometry, device, model.dtype)
    seen: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def grab(i: int):
        def hook(_module, args, kwargs):
            seen[i] = (kwargs.get("hidden_states", args[0] if args else None), kwargs["position_embeddings"])
            if i == deepest:
                raise _Stop
        return hook

    handles = [a.register_forward_pre_hook(grab(i), with_kwargs=True) for i, a in zip(layers, attns)]
    try:
        forward_base(model, asm.new_ids, asm.new_positions, asm.cache, asm.mask)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    # the question's tokens are the new ones after the last cached token
    cached_seq, new_seq, at = [], [], 0
    for p in pieces:
        (cached_seq if p.cached else new_seq).extend(range(at, at + len(p.token_ids)))
        at += len(p.token_ids)
    after = torch.tensor([s > cached_seq[-1] for s in new_seq], device=device)
    mass = torch.zeros(asm.num_cached, dtype=torch.float32, device=device)
    rotary = sys.modules[type(attns[0]).__module__].apply_rotary_pos_emb
    for i, attn in zip(layers, attns):
        h, (cos, sin) = seen[i]  # h: [1, N, hidden]
        q = attn.q_proj(h).view(1, h.shape[1], -1, geometry.head_dim).transpose(1, 2)  # [1, Hq, N, D]
        q = rotary(q, q, cos, sin)[0][0][:, after]  # [Hq, Nq, D]
        keys = asm.cache.layers[i].keys[0, :, : asm.num_cached]  # [Hkv, C, D]
        keys = keys.repeat_interleave(q.shape[0] // keys.shape[0], dim=0)
        scores = (q.float() @ keys.float().transpose(-1, -2)) * geometry.head_dim ** -0.5  # [Hq, Nq, C]
        mass += scores.softmax(-1).sum((0, 1))
    release(asm.cache)
    return mass / len(layers)


def choose(stale: Stale, mass: torch.Tensor, sel: Selection, sentence_end: frozenset[int] = frozenset()) -> set[int]:
    """Sequence indices to recompute. `sentence_end`: token ids that close a sentence (shape `sentences`)."""
    n = len(stale.seq)
    assert mass.shape[0] == n, f"{mass.shape=} {n=}"
    ok = list(stale.choosable)
    modules = list(dict.fromkeys(u for u, c in zip(stale.unit, ok) if c))
    if sel.near:
        keep = set(modules[-sel.near:])
        ok = [c and u in keep for c, u in zip(ok, stale.unit)]
    budget = round(sel.ratio * sum(ok))  # with `near`, a share of those modules' tokens
    picked: set[int] = set()  # cache indices
    if sel.whole:
        full = set(modules[-sel.whole:])
        picked.update(c for c, u in enumerate(stale.unit) if ok[c] and u in full)
        ok = [c and u not in full for c, u in zip(ok, stale.unit)]
    if sel.sinks:
        first: dict[str, int] = {}
        for c, u in enumerate(stale.unit):
            if stale.choosable[c] and first.setdefault(u, c) > c - sel.sinks:
                picked.add(c)
    scores = mass.masked_fill(~torch.tensor(ok, device=mass.device), -1.0)
    spent = 0
    if sel.shape == "tokens":
        for c in torch.argsort(scores, descending=True).tolist():
            if spent >= budget or scores[c] < 0:
                break
            for d in range(c - sel.window, c + sel.window + 1):
                if 0 <= d < n and ok[d] and stale.unit[d] == stale.unit[c] and d not in picked:
                    picked.add(d)
                    spent += 1
    else:
        spans = _sentences(stale, ok, sentence_end)
        totals = [float(mass[a:b].sum()) for a, b in spans]
        for j in sorted(range(len(spans)), key=lambda j: -totals[j]):
            a, b = spans[j]
            if spent + (b - a) > budget and spent:
                continue
            if spent >= budget:
                break
            picked.update(range(a, b))
            spent += b - a
    return {stale.seq[c] for c in picked}


def _sentences(stale: Stale, ok: list[bool], ends: frozenset[int]) -> list[tuple[int, int]]:
    """[start, stop) cache index spans of choosable sentences, split at `ends` and at module edges."""
    spans = []
    start = None
    for c in range(len(stale.seq) + 1):
        edge = c == len(stale.seq) or not ok[c] or (start is not None and stale.unit[c] != stale.unit[start])
        if start is not None and edge:
            spans.append((start, c))
            start = None
        if c == len(stale.seq):
            break
        if ok[c] and start is None:
            start = c
        if start is not None and stale.token_ids[c] in ends:
            spans.append((start, c + 1))
            start = None
    return spans


def exact_module(pieces: Sequence[Piece], kvs: dict[str, ModuleKV]) -> str | None:
    """The first module, when its KV is already what full prefill computes: encoded after the same
    context it follows here (shared_prefix) and not moved. Recomputing it would change nothing."""
    first = next((p for p in pieces if p.cached and p.unit != ROOT), None)
    if first is None or kvs[first.unit].mode != "shared_prefix":
        return None
    moved = any(p.unit == first.unit and p.position != kvs[p.unit].start + p.offset for p in pieces)
    return None if moved else first.unit


class _Stop(Exception):
    pass
