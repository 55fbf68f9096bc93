"""Module encoding: run the model over units and keep each one's KV as a `ModuleKV`.

Two encoding modes:
- `isolated`: a unit alone at its encoding position (the paper's way);
- `shared_prefix`: a unit after its context (the tokens before it in its smallest prompt: BOS, the
  system text), keeping only the unit's own KV. It sees the start of context that full prefill sees.

A unit with neighbours (`Unit.neighbour_ids`: other modules' tokens the schema puts before it, its
nearest look-alikes in a corpus) is encoded after its context (in `isolated` mode: none) and those
tokens, only its own KV kept, and its keys rotated back by the neighbours' length with the model's
relocator: the stored KV starts at the unit's usual `encode_start`, so assembly places it like any other,
and it has read the text a question most likely retrieves beside it. Both modes take neighbours the same
way; a model whose keys cannot be moved (`Relocator.relocatable` False) refuses them.

Units are batched with right padding: under a causal mask a real token never attends to the padding
after it, so no attention mask is needed. A batch holds units of similar lengths, at most `batch_size`
and at most MAX_PADDING of its tokens padding (`batches`): the padding is computed like any token, and
on a CPU a row of ~200 tokens already runs the linear maps about as fast per token as a batch of eight
(measured on the default model, one thread: 549 against 546 tokens/s). With batches only sorted by
length, an eager ingest of the sample topics (chunks of 33-258 tokens) ran 381 tokens/s; bounded, 440
(one thread, the other core busy). This module does not look anything up or store anything.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from rag_promptcache.engine.kv.assemble import full_cache
from rag_promptcache.engine.prompt.compiler import Unit
from rag_promptcache.engine.compute.runner import forward_base
from rag_promptcache.model.positions import Relocator, kv_geometry, relocator_for
from rag_promptcache.store.base import ModuleKV

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MODES: tuple[str, ...] = ("isolated", "shared_prefix")
# Why shared_prefix is the default: docs/fidelity.md (its logits table, `rag-promptcache bench` quality scenario).
DEFAULT_MODE = "shared_prefix"
MAX_PADDING = 0.1  # of a batch's tokens


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown encoding mode {mode!r}; valid: {', '.join(MODES)}")
    return mode


def stack_layers(cache: DynamicCache, row: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch row of a cache, tokens start..end → keys, values: [L, H, S, D] (copies)."""
    keys = torch.stack([layer.keys[row, :, start:end] for layer in cache.layers])
    values = torch.stack([layer.values[row, :, start:end] for layer in cache.layers])
    return keys.contiguous(), values.contiguous()


@torch.inference_mode()
def encode_units(
    model: PreTrainedModel,
    units: Sequence[Unit],
    *,
    mode: str,
    fingerprint: str,
    batch_size: int = 8,
    relocator: Relocator | None = None,
) -> list[ModuleKV]:
    """Encode `units` (any order, any lengths) and return their ModuleKVs in the same order.
    `relocator`: the model's (default: `relocator_for(model)`), for units with neighbours."""
    check_mode(mode)
    out: dict[int, ModuleKV] = {}
    # (the tokens before the units, the position of the first of them) -> units
    groups: dict[tuple[tuple[int, ...], int], list[int]] = defaultdict(list)
    for i, u in enumerate(units):
        assert u.token_ids, f"{u.name=} has no tokens"
        context = u.context_ids if mode == "shared_prefix" else ()
        # without neighbours a unit's context starts at 0 (its whole smallest prompt) or is empty; with
        # them, an isolated unit's neighbours start at its own encode_start
        first = u.encode_start - len(context) if u.neighbour_ids else 0
        groups[(context + u.neighbour_ids, first)].append(i)
    if any(u.neighbour_ids for u in units):
        relocator = relocator or relocator_for(model)
        if not relocator.relocatable:
            raise ValueError(f"modules with neighbours need a model whose keys can be moved after encoding; "
                             f"{type(model).__name__}'s cannot (encode them without neighbours)")
        end = max(u.encode_start + len(u.neighbour_ids) + len(u.token_ids) for u in units if u.neighbour_ids)
        limit = relocator.exact_below or getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if limit is not None and end > limit:
            raise ValueError(f"a module after its neighbours reaches position {end}, past the {limit} this model "
                             "encodes exactly; use fewer neighbours or shorter chunks")
    for (before, first), idx in groups.items():
        idx.sort(key=lambda i: len(units[i].token_ids))  # similar lengths share a batch: less padding
        prefix = _prefix_kv(model, before, first) if before else None
        for part in batches([len(units[i].token_ids) for i in idx], batch_size):
            kvs = _encode_batch(model, [units[idx[j]] for j in part], prefix, mode, fingerprint, relocator)
            for j, kv in zip(part, kvs):
                out[idx[j]] = kv
    return [out[i] for i in range(len(units))]


def batches(lengths: Sequence[int], batch_size: int, max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Indices into `lengths` (ascending) in batches of at most `batch_size`, each padded to its longest
    with at most `max_padding` of its tokens padding (a unit alone never is)."""
    out: list[list[int]] = []
    part: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if part and (len(part) == batch_size or (len(part) + 1) * n - (total + n) > max_padding * (len(part) + 1) * n):
            out.append(part)
            part, total = [], 0
        part.append(i)
        total += n
    return [*out, part] if part else out


def _prefix_kv(model: PreTrainedModel, context: tuple[int, ...], first: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    device = model.device
    ids = torch.tensor([context], device=device)
    cache = full_cache(model.config, kv_geometry(model))
    forward_base(model, ids, torch.arange(first, first + len(context), device=device)[None], cache)
    return [(layer.keys, layer.values) for layer in cache.layers]  # each [1, H, C, D]


def _encode_batch(
    model: PreTrainedModel,
    batch: list[Unit],
    prefix: list[tuple[torch.Tensor, torch.Tensor]] | None,
    mode: str,
    fingerprint: str,
    relocator: Relocator | None,
) -> list[ModuleKV]:
    device = model.device
    shift = len(batch[0].neighbour_ids)  # one group: the same neighbours for every unit of the batch
    width = max(len(u.token_ids) for u in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    pos = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    for r, u in enumerate(batch):
        n = len(u.token_ids)
        ids[r, :n] = torch.tensor(u.token_ids, device=device)
        ids[r, n:] = u.token_ids[-1]
        pos[r] = torch.arange(u.encode_start + shift, u.encode_start + shift + width, device=device)
    # every layer keeps every token (a module may be longer than a sliding window): full_cache
    if prefix is None:
        cache = full_cache(model.config, kv_geometry(model))
        skip = 0
    else:
        # the shared context, broadcast over the batch: [1, H, C, D] -> [B, H, C, D]
        cache = full_cache(model.config, kv_geometry(model),
                           [(k.expand(len(batch), -1, -1, -1), v.expand(len(batch), -1, -1, -1)) for k, v in prefix])
        skip = prefix[0][0].shape[2]
    forward_base(model, ids, pos, cache)  # a unit after a shared prefix is a masked prefill
    assert cache.layers[0].keys.shape[2] == skip + width, f"{cache.layers[0].keys.shape=} {skip=} {width=}"
    result = []
    for r, u in enumerate(batch):
        keys, values = stack_layers(cache, r, skip, skip + len(u.token_ids))
        if shift:  # encoded `shift` positions late, after the neighbours: back to the unit's own place
            assert relocator is not None
            keys = relocator.rotate(keys, torch.full((len(u.token_ids),), -shift, device=keys.device)).contiguous()
        result.append(ModuleKV(keys, values, u.encode_start, u.token_ids, fingerprint, mode))
    return result
