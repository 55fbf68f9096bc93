"""Quality recovery: recompute a few cached tokens in the prefill so the answer drifts less.

A module encoded on its own never attended to the modules before it (Prompt Cache §3.3). Each
strategy picks cached tokens to compute again, in place, against everything before them:

- `first_k:K` (as EPIC): the first K tokens of every cached piece, the tokens that otherwise each
  act as an attention sink. The piece that opens the sequence at its encoded position is exact
  already and is left alone.
- `selective:R` (as CacheBlend): the fraction R of cached tokens whose KV deviates most from a fresh
  computation, measured at an early layer (`@L`, default 1) by a prefill truncated after that layer.
- `last:N`: the N retrieved modules nearest the question, whole. A corpus puts its best-ranked
  module there, so this recomputes the module the answer most likely comes from against the others.
  A first module that is exact already (shared_prefix, not moved) is never counted.
- `tail:T`: the last T tokens of the module nearest the question (the one `last:1` recomputes whole),
  so the tokens the question sits next to read the other modules, for T tokens' prefill instead of
  the module's. It keeps the answers on short chunks only (docs/FIDELITY.md, 2026-11-28). T at least
  the module's length is `last:1`.
- `question:R` (question-aware, issue 26): the stale module nearest the question whole, plus the
  fraction R of the other modules' tokens the question attends to most (engine/planning/select.py), read at
  layers L/2, L, 3L/2 (`@L`, default 8).
- `attend:N` (query-aware): the N modules the question's tokens attend to most at layer `@L`
  (default 8), found by running the question over the assembled cache up to that layer, recomputed
  whole. Needs attention with a `q_proj` (Llama, Mistral, Qwen, Gemma families).
- `links:N` (KVLink): recomputes nothing, but places N learned link tokens (model/links.py) after
  each retrieved module as new tokens, every later token moved along. Computed with the question in
  the one prefill, each sees the modules and links before it, so the question reads the modules as
  stored plus what the links carry of how they relate. Only a model whose adapter trained links.

Any of them may apply only to prompts of at least K retrieved modules (`last:1@k>=5`): a smaller prompt reads
every module as stored (`none`), the choice by what the prompt holds (docs/FIDELITY.md, 2026-12-04).

The others only split pieces: the chosen tokens become new tokens, and the assembler's mask keeps
the single prefill causal. Recomputing everything is full prefill; recomputing nothing is `none`.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from transformers import DynamicCache

from rag_promptcache.engine.kv.assemble import assemble, full_cache
from rag_promptcache.engine.prompt.compiler import ROOT, Piece
from rag_promptcache.engine.compute.runner import decoder_layers, forward_base
from rag_promptcache.engine.planning.select import Selection, choose, exact_module, question_mass, stale_tokens
from rag_promptcache.model import links
from rag_promptcache.model.positions import KVGeometry, Relocator
from rag_promptcache.store.base import ModuleKV

if TYPE_CHECKING:
    from transformers import PreTrainedModel

KINDS: tuple[str, ...] = ("none", "first_k", "selective", "last", "attend", "question", "links", "tail")
DEFAULT_LAYER = {"selective": 1, "attend": 8, "question": 8}
# Chosen on answers, not logits (docs/FIDELITY.md, `rag-promptcache bench --scenarios fidelity`): the
# fastest setting keeping >= 95% of full prefill's right answers at k = 4, 8 and 12 on both the bench
# split and the held-out one (look-alike ~250-token records at the default chunk size), pooled over two
# draws of each. With the best-ranked modules next to the question, recomputing the three nearest whole
# kept 0.97-1.18; last:2 kept 0.90 and 0.92 of the held-out answers at k = 8 and 12, last:1 0.84 and 0.79,
# question:0.05 0.89 and 0.92; none loses most answers.
DEFAULT_RECOVERY = "last:3"


@dataclass(frozen=True, slots=True)
class Recovery:
    kind: Literal["none", "first_k", "selective", "last", "attend", "question", "links", "tail"] = "none"
    # K tokens for first_k; a fraction R in [0, 1] for selective and question; N modules for last/attend;
    # T tokens for tail; N link tokens per module for links
    budget: float = 0.0
    # selective: where deviation is measured; attend: where the question's attention is read; question: L
    # reads it at L/2, L and 3L/2 (the default 8: layers 4, 8, 12, as engine/planning/select.py's probe measured)
    layer: int = 1
    # recover only in prompts of at least this many retrieved modules (`@k>=N`); fewer are read as stored (0: always)
    min_modules: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown recovery {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.min_modules < 0 or self.min_modules != int(self.min_modules):
            raise ValueError(f"@k>=N needs a whole number of modules N >= 0, got {self.min_modules}")
        if self.kind == "none" and self.min_modules:
            raise ValueError("none recovers nothing in any prompt: @k>=N needs another recovery (last:1@k>=5)")
        if self.kind in ("first_k", "tail") and (self.budget < 0 or self.budget != int(self.budget)):
            letter = "k" if self.kind == "first_k" else "t"
            raise ValueError(f"{self.kind} needs a whole number of tokens {letter} >= 0, got {self.budget}")
        if self.kind in ("last", "attend") and (self.budget < 0 or self.budget != int(self.budget)):
            raise ValueError(f"{self.kind} needs a whole number of modules n >= 0, got {self.budget}")
        if self.kind == "links" and (self.budget < 0 or self.budget != int(self.budget)):
            raise ValueError(f"links needs a whole number of link tokens per module n >= 0, got {self.budget}")
        if self.kind in ("selective", "question") and not 0 <= self.budget <= 1:
            raise ValueError(f"{self.kind} needs a fraction r in [0, 1], got {self.budget}")
        if self.layer < 0:
            raise ValueError(f"the deviation layer must be >= 0, got {self.layer}")

    @classmethod
    def parse(cls, spec: str | Recovery | None) -> Recovery:
        """"none", "first_k:8", "selective:0.15[@2]", "last:1", "tail:32", "attend:1[@8]", "question:0.05[@8]",
        "links:4"; any but none may end in "@k>=N" (from N retrieved modules on; fewer: none)."""
        if spec is None:
            return cls()
        if isinstance(spec, Recovery):
            return spec
        head, _, at_least = spec.partition("@k>=")
        kind, _, rest = head.partition(":")
        budget, _, layer = rest.partition("@")
        try:
            return cls(kind, float(budget) if budget else 0.0,  # type: ignore[arg-type]
                       int(layer) if layer else DEFAULT_LAYER.get(kind, 1), int(at_least) if at_least else 0)
        except ValueError as e:
            if "valid:" in str(e) or "needs" in str(e) or "layer" in str(e):
                raise
            raise ValueError(f"bad recovery {spec!r}: write none, first_k:K, selective:R[@layer], last:N, tail:T, "
                             "attend:N[@layer], question:R[@layer] or links:N, any but none followed by @k>=N "
                             "to recover only in prompts of N modules or more") from e

    def __str__(self) -> str:
        if self.kind == "none":
            return "none"
        budget = self.budget if self.kind in ("selective", "question") else int(self.budget)
        layer = DEFAULT_LAYER.get(self.kind)
        return (f"{self.kind}:{budget}" + (f"@{self.layer}" if layer is not None and self.layer != layer else "")
                + (f"@k>={self.min_modules}" if self.min_modules else ""))


def recover(
    recovery: Recovery,
    pieces: Sequence[Piece],
    kvs: dict[str, ModuleKV],
    model: PreTrainedModel,
    relocator: Relocator,
    geometry: KVGeometry,
    order: Sequence[str] | None = None,
) -> list[Piece]:
    """The pieces with the chosen cached tokens turned into new ones. `order`: every retrieved module in
    sequence order, including those the planner already turned into new tokens (a deferred miss), which
    `last:N` and `tail:T` count among the nearest as already recomputed; None: the cached ones. A prompt of
    fewer modules than `recovery.min_modules` is returned as it is."""
    if recovery.min_modules and len(_module_order(pieces) if order is None else order) < recovery.min_modules:
        return list(pieces)
    if recovery.kind == "question":  # budget 0 still recomputes the nearest module whole
        chosen = _question(pieces, kvs, model, relocator, geometry, recovery)
        return split(pieces, chosen)
    if recovery.kind == "none" or recovery.budget == 0:
        return list(pieces)
    if recovery.kind == "links":
        return with_links(pieces, links.ids(model, int(recovery.budget)))
    if recovery.kind == "first_k":
        chosen = _first_k(pieces, kvs, int(recovery.budget))
    elif recovery.kind in ("last", "tail"):
        exact = exact_module(pieces, kvs)
        stale = [m for m in (_module_order(pieces) if order is None else order) if m != exact]
        if recovery.kind == "last":
            chosen = _modules(pieces, stale[-int(recovery.budget):])
        else:  # the nearest stale module's last T cached tokens
            chosen = set(sorted(_modules(pieces, stale[-1:]))[-int(recovery.budget):])
    elif recovery.kind == "attend":
        chosen = _modules(pieces, _most_attended(pieces, kvs, model, relocator, geometry, int(recovery.budget),
                                                 recovery.layer))
    else:
        chosen = _most_deviating(pieces, kvs, model, relocator, geometry, recovery.budget, recovery.layer)
    return split(pieces, chosen)


def with_links(pieces: Sequence[Piece], link_ids: Sequence[int]) -> list[Piece]:
    """The pieces with `link_ids` as new tokens right after each retrieved module's last cached piece,
    every later piece moved along by the links before it (the schema's own text gets none)."""
    ends = {i for i in {p.unit: i for i, p in enumerate(pieces) if p.cached and p.unit != ROOT}.values()}
    out: list[Piece] = []
    shift = 0
    for i, p in enumerate(pieces):
        out.append(dataclasses.replace(p, position=p.position + shift) if shift else p)
        if i in ends and link_ids:
            out.append(Piece(tuple(link_ids), p.position + shift + len(p.token_ids)))
            shift += len(link_ids)
    return out


def question_layers(layer: int) -> tuple[int, ...]:
    """Where `question:R@L` reads the question's attention: L/2, L and 3L/2 (at least layer 0)."""
    return tuple(sorted({layer // 2, layer, layer + layer // 2}))


def _question(pieces: Sequence[Piece], kvs: dict[str, ModuleKV], model: PreTrainedModel, relocator: Relocator,
              geometry: KVGeometry, recovery: Recovery) -> set[int]:
    """The stale module nearest the question whole, plus the fraction R of the other stale tokens the
    question attends to most (engine/planning/select.py; the research behind it is docs/FIDELITY.md's issue 26
    section). Nothing to score when no other stale module is left."""
    stale = stale_tokens(pieces, kvs)
    depth = len(_decoder_layers(model))
    if recovery.layer >= depth:
        raise ValueError(f"question recovery layer {recovery.layer} is past the model's {depth} layers")
    # 3L/2 may pass a shallow model's last layer: read the deepest there is instead
    layers = tuple(sorted({min(i, depth - 1) for i in question_layers(recovery.layer)}))
    sel = Selection(recovery.budget, layers=layers, whole=1)
    others = len({u for u, ok in zip(stale.unit, stale.choosable) if ok}) > 1
    if not others or recovery.budget == 0:
        mass = torch.zeros(len(stale.seq))
    else:
        mass = question_mass(pieces, kvs, model, relocator, geometry, sel.layers)
    return choose(stale, mass, sel)


def split(pieces: Sequence[Piece], chosen: set[int]) -> list[Piece]:
    """Turn the cached tokens at sequence indices `chosen` into new tokens, keeping order."""
    out: list[Piece] = []
    seq = 0
    for p in pieces:
        n = len(p.token_ids)
        if not p.cached or not any(seq + i in chosen for i in range(n)):
            out.append(p)
        else:
            i = 0
            while i < n:
                fresh = seq + i in chosen
                j = i
                while j < n and (seq + j in chosen) == fresh:
                    j += 1
                ids = p.token_ids[i:j]
                out.append(Piece(ids, p.position + i) if fresh else Piece(ids, p.position + i, p.unit, p.offset + i))
                i = j
        seq += n
    return out


def _first_k(pieces: Sequence[Piece], kvs: dict[str, ModuleKV], k: int) -> set[int]:
    chosen: set[int] = set()
    seq = 0
    for i, p in enumerate(pieces):
        exact = i == 0 and p.cached and p.position == kvs[p.unit].start + p.offset
        if p.cached and not exact:
            chosen.update(range(seq, seq + min(k, len(p.token_ids))))
        seq += len(p.token_ids)
    return chosen


def _module_order(pieces: Sequence[Piece]) -> list[str]:
    """Cached modules in sequence order; the schema's own text (the root) is not a module."""
    return list(dict.fromkeys(p.unit for p in pieces if p.cached and p.unit != ROOT))


def _modules(pieces: Sequence[Piece], names: Sequence[str]) -> set[int]:
    """Sequence indices of every cached token of the named modules."""
    wanted = set(names)
    chosen: set[int] = set()
    seq = 0
    for p in pieces:
        if p.cached and p.unit in wanted:
            chosen.update(range(seq, seq + len(p.token_ids)))
        seq += len(p.token_ids)
    return chosen


class _Stop(Exception):
    pass


@torch.inference_mode()
def _most_attended(
    pieces: Sequence[Piece],
    kvs: dict[str, ModuleKV],
    model: PreTrainedModel,
    relocator: Relocator,
    geometry: KVGeometry,
    num: int,
    layer: int,
) -> list[str]:
    """The `num` modules holding the most attention mass of the question's tokens at `layer`."""
    names = _module_order(pieces)
    if num >= len(names):
        return names
    layers = _decoder_layers(model)
    if layer >= len(layers):
        raise ValueError(f"attention layer {layer} is past the model's {len(layers)} layers")
    attn = layers[layer].self_attn if hasattr(layers[layer], "self_attn") else None
    if attn is None or not hasattr(attn, "q_proj"):
        raise ValueError(f"attend recovery reads queries through q_proj, which {type(model).__name__} lacks; "
                         "use last:N or selective:R")
    device = model.device
    asm = assemble(pieces, kvs, relocator, model.config, geometry, device, model.dtype)
    seen: dict[str, object] = {}

    def grab(_module, args, kwargs):
        seen["h"] = kwargs.get("hidden_states", args[0] if args else None)
        seen["pe"] = kwargs.get("position_embeddings")
        raise _Stop

    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        forward_base(model, asm.new_ids, asm.new_positions, asm.cache, asm.mask)
    except _Stop:
        pass
    finally:
        handle.remove()
    h, (cos, sin) = seen["h"], seen["pe"]  # h: [1, N, hidden]
    q = attn.q_proj(h).view(1, h.shape[1], -1, geometry.head_dim)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    q = q.transpose(1, 2)  # [1, Hq, N, D]
    rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
    q = rotary(q, q, cos, sin)[0][0]  # [Hq, N, D]
    keys = asm.cache.layers[layer].keys[0, :, : asm.num_cached]  # [Hkv, C, D], in cache (= sequence) order
    keys = keys.repeat_interleave(q.shape[0] // keys.shape[0], dim=0)
    # the question's tokens are the new ones after the last cached token
    cached_seq, new_seq, seq = [], [], 0
    for p in pieces:
        (cached_seq if p.cached else new_seq).extend(range(seq, seq + len(p.token_ids)))
        seq += len(p.token_ids)
    after = torch.tensor([s > cached_seq[-1] for s in new_seq], device=device)
    scores = (q[:, after].float() @ keys.float().transpose(-1, -2)) * geometry.head_dim ** -0.5  # [Hq, Nq, C]
    mass = scores.softmax(-1).sum((0, 1))  # [C]
    unit_of = [p.unit for p in pieces if p.cached for _ in p.token_ids]
    per: dict[str, float] = dict.fromkeys(names, 0.0)
    for u, m in zip(unit_of, mass.tolist()):
        if u in per:
            per[u] += m
    return sorted(names, key=lambda n: -per[n])[:num]


@torch.inference_mode()
def _most_deviating(
    pieces: Sequence[Piece],
    kvs: dict[str, ModuleKV],
    model: PreTrainedModel,
    relocator: Relocator,
    geometry: KVGeometry,
    ratio: float,
    layer: int,
) -> set[int]:
    cached_seq: list[int] = []
    seq = 0
    for p in pieces:
        if p.cached:
            cached_seq.extend(range(seq, seq + len(p.token_ids)))
        seq += len(p.token_ids)
    num = round(ratio * len(cached_seq))
    if num == 0:
        return set()
    if num >= len(cached_seq):
        return set(cached_seq)
    device = model.device
    asm = assemble(pieces, kvs, relocator, model.config, geometry, device, model.dtype)
    fresh = _early_cache(model, pieces, layer, geometry)
    idx = torch.tensor(cached_seq, device=device)
    # each [H, C, D]: the same tokens at the same positions, fresh against cached
    dk = fresh.layers[layer].keys[0, :, idx] - asm.cache.layers[layer].keys[0]
    dv = fresh.layers[layer].values[0, :, idx] - asm.cache.layers[layer].values[0]
    deviation = dk.float().pow(2).sum((0, 2)) + dv.float().pow(2).sum((0, 2))  # [C]
    top = torch.topk(deviation, num).indices
    return {cached_seq[i] for i in top.tolist()}


def _early_cache(model: PreTrainedModel, pieces: Sequence[Piece], layer: int, geometry: KVGeometry) -> DynamicCache:
    """A full prefill of the sequence, stopped after decoder layer `layer`: its KV up to there, every
    token's in every layer (`full_cache`), as the assembled cache it is compared with holds them."""
    layers = _decoder_layers(model)
    if layer >= len(layers):
        raise ValueError(f"deviation layer {layer} is past the model's {len(layers)} layers")
    device = model.device
    ids = torch.tensor([[t for p in pieces for t in p.token_ids]], device=device)
    pos = torch.tensor([[p.position + i for p in pieces for i in range(len(p.token_ids))]], device=device)
    cache = full_cache(model.config, geometry)

    def stop(*_):
        raise _Stop

    handle = layers[layer].register_forward_hook(stop)
    try:
        forward_base(model, ids, pos, cache)
    except _Stop:
        pass
    finally:
        handle.remove()
    return cache


def _decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"selective recovery cannot find the decoder layers of {type(model).__name__}")
    return layers
