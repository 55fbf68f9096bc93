"""The batched KV cache and the batched decode step, gpt-fast style.

One preallocated buffer per layer, keys and values [B, H, capacity, D]. Row b holds one sequence's
assembled prompt KV (copied in after its own prefill) and its answer so far; rows have different
lengths. A decode step feeds one token per running row (`ids` [n, 1], each row at its own position)
and `BatchLayer.update` writes each row's new K/V at that row's own length (scatter by index). The
step attends over the first `span` = longest row + 1 slots with an additive mask that hides each
row's unused tail, so a short row is masked, never padded by recomputation. Running rows are the
first n rows (the scheduler keeps them packed), so the step uses views, never a gather.

`decode_row` runs several tokens of one row alone through the single-sequence forward: the
batcher's prompt lookup check for a request running alone.

`mixed_step` is a decode step that also carries a chunk of each of several new requests' prefills
(engine/planning/prefill.py `Chunk`, each against that request's own assembled cache; a whole prefill
is one chunk), Sarathi/vLLM style: the running rows' tokens and the chunks' go through every linear
map as the rows of one matrix, and only attention is per sequence (the rows against the batch cache,
each chunk against its cache). With no running rows it is several prefills in one forward. A decode
step alone is bound by reading the weights; riding on chunks that read them anyway, it costs about
its share of the arithmetic. Lean Llama forward only (`can_mix`); other models run the chunks and the
step apart.

Not here: who runs when (`scheduler.py`, `batcher.py`), sampling (`sampling.py`), which forward runs
(`runner.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

import torch.nn.functional as F

from rag_promptcache.engine.compute import attention
from rag_promptcache.model.rotary import apply_rotary_pos_emb
from rag_promptcache.engine.kv.assemble import ReservedLayer
from rag_promptcache.engine.planning.prefill import Chunk
from rag_promptcache.engine.compute.graphs import batch_graphs
from rag_promptcache.engine.compute.runner import forward_batch, forward_logits, lean_forward
from rag_promptcache.model.positions import KVGeometry

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class BatchLayer(DynamicLayer):
    def __init__(self, keys: torch.Tensor, values: torch.Tensor, step: BatchStep) -> None:
        super().__init__()
        self._keys, self._values = keys, values  # [B, H, capacity, D]
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.step = step
        self.keys, self.values = keys[:0], values[:0]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [n, H, 1, D] → written at (row b, slot lengths[b]) for each running row b
        s = self.step
        self._keys[s.rows, :, s.lengths] = key_states[:, :, 0]
        self._values[s.rows, :, s.lengths] = value_states[:, :, 0]
        self.keys, self.values = self._keys[: s.n, :, : s.span], self._values[: s.n, :, : s.span]
        return self.keys, self.values


class BatchStep:
    """Per-step state every layer reads: the running rows, their lengths before this token, the span."""

    def __init__(self) -> None:
        self.n = 0
        self.span = 0
        self.rows = torch.zeros(0, dtype=torch.long)
        self.lengths = torch.zeros(0, dtype=torch.long)


class BatchCache:
    """`max_batch` rows of KV with `capacity` slots each; grows (once, by copying) when a row needs more."""

    @torch.inference_mode()  # the buffers are inference tensors: every write happens in the mode
    def __init__(self, config: PretrainedConfig, g: KVGeometry, max_batch: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        probe = DynamicCache(config=config)
        if len(probe.layers) != g.num_layers or any(type(layer) is not DynamicLayer for layer in probe.layers):
            raise ValueError(f"batched decoding needs full-attention layers only; {config.model_type} uses "
                             "sliding-window or other layer types: generate one request at a time")
        self.config, self.geometry, self.dtype, self.device = config, g, dtype, device
        self.max_batch = max_batch
        self.step = BatchStep()
        self.lengths = [0] * max_batch  # tokens of KV held per row
        self.keys = torch.zeros(g.num_layers, max_batch, g.num_kv_heads, capacity, g.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.cache = self._wrap()

    @property
    def capacity(self) -> int:
        return self.keys.shape[-2]

    def _wrap(self) -> DynamicCache:
        cache = DynamicCache(config=self.config)
        cache.layers[:] = [BatchLayer(k, v, self.step) for k, v in zip(self.keys, self.values)]
        return cache

    @torch.inference_mode()  # the buffers are inference tensors: every write happens in the mode
    def reserve(self, tokens: int) -> None:
        """Make every row hold at least `tokens` slots."""
        if tokens <= self.capacity:
            return
        grow = max(tokens, 2 * self.capacity) - self.capacity
        pad = (*self.keys.shape[:-2], grow, self.keys.shape[-1])
        self.keys = torch.cat([self.keys, self.keys.new_zeros(pad)], dim=-2)
        self.values = torch.cat([self.values, self.values.new_zeros(pad)], dim=-2)
        self.cache = self._wrap()

    @torch.inference_mode()  # the buffers are inference tensors: every write happens in the mode
    def load(self, row: int, prompt_cache: DynamicCache, room: int = 1) -> None:
        """Copy one prefilled sequence's KV (its own cache, batch 1) into `row`, with `room` slots to spare."""
        n = prompt_cache.layers[0].keys.shape[-2]
        self.reserve(n + room)
        for i, layer in enumerate(prompt_cache.layers):
            # layer.keys: [1, H, n, D]
            self.keys[i, row, :, :n] = layer.keys[0]
            self.values[i, row, :, :n] = layer.values[0]
        self.lengths[row] = n

    @torch.inference_mode()  # the buffers are inference tensors: every write happens in the mode
    def move(self, src: int, dst: int) -> None:
        n = self.lengths[src]
        self.keys[:, dst, :, :n] = self.keys[:, src, :, :n]
        self.values[:, dst, :, :n] = self.values[:, src, :, :n]
        self.lengths[dst] = n


def _begin_step(batch: BatchCache, n: int) -> torch.Tensor:
    """Set the step state for the first n rows → the mask [n, 1, 1, span]: 0 where a row has KV (its
    new token included), the dtype's min elsewhere."""
    device = batch.device
    lengths = batch.lengths[:n]
    batch.reserve(max(lengths) + 1)
    s = batch.step
    s.n, s.span = n, max(lengths) + 1
    s.rows = torch.arange(n, device=device)
    s.lengths = torch.tensor(lengths, device=device)
    slots = torch.arange(s.span, device=device)
    mask = torch.zeros(n, 1, 1, s.span, dtype=batch.dtype, device=device)
    mask.masked_fill_((slots[None, :] > s.lengths[:, None])[:, None, None, :], torch.finfo(batch.dtype).min)
    return mask


@torch.inference_mode()
def decode_step(model: PreTrainedModel, batch: BatchCache, ids: list[int], positions: list[int], *,
                lean: bool = True) -> torch.Tensor:
    """One token for each of the first len(ids) rows → next-token logits [n, V] fp32. `lean`: the lean
    forward's batched step where the model has one (engine/compute/forward.py), on CUDA a graph of it per
    number of rows (engine/compute/graphs.py); False: transformers'."""
    n = len(ids)
    device = batch.device
    batch.reserve(max(batch.lengths[:n]) + 1)  # before the graphs: reserving may move the buffers
    graphs = batch_graphs(model, batch, batch.keys, batch.values) if lean else None
    if graphs is not None:
        logits = graphs(ids, positions, batch.lengths[:n])
        for r in range(n):
            batch.lengths[r] += 1
        return logits
    mask = _begin_step(batch, n)
    input_ids = torch.tensor(ids, device=device)[:, None]  # [n, 1]
    position_ids = torch.tensor(positions, device=device)[:, None]  # [n, 1]
    logits = forward_batch(model, input_ids, position_ids, batch.cache, mask, lean=lean)
    for r in range(n):
        batch.lengths[r] += 1
    return logits


@torch.inference_mode()
def decode_row(model: PreTrainedModel, batch: BatchCache, row: int, ids: list[int], position: int) -> torch.Tensor:
    """Run several tokens of one row alone (a prompt lookup check while it is the only one running),
    starting at `position` → their logits [len(ids), V] fp32. Their KV is written after the row's; the
    caller sets `batch.lengths[row]` back by the tokens it rejects."""
    n = batch.lengths[row]
    batch.reserve(n + len(ids))  # before the views: reserving may move the buffers
    cache = DynamicCache(config=batch.config)
    # views of the row: ReservedLayer writes into them in place (it never grows, room was reserved)
    cache.layers[:] = [ReservedLayer(k[row : row + 1], v[row : row + 1], n) for k, v in zip(batch.keys, batch.values)]
    x = torch.tensor([ids], device=batch.device)  # [1, N]
    positions = torch.arange(position, position + len(ids), device=batch.device)[None]
    logits = forward_logits(model, x, positions, cache, keep=len(ids))
    batch.lengths[row] = n + len(ids)
    return logits


def can_mix(model: PreTrainedModel) -> bool:
    """Whether `mixed_step` runs for this model (it has the lean forward)."""
    return lean_forward(model) is not None


@torch.inference_mode()
def mixed_step(model: PreTrainedModel, batch: BatchCache, ids: list[int], positions: list[int],
               prefills: Sequence[tuple[DynamicCache, Chunk]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`decode_step` of the first len(ids) rows (none: no decode step) and one chunk of each prefill in
    `prefills`, each against its own cache (a reserved cache: it takes the chunk's KV), in one forward
    → (the rows' next-token logits [n, V], each chunk's last token's [V]), fp32."""
    lean = lean_forward(model)
    assert lean is not None, f"{type(model).__name__} has no lean forward: check can_mix"
    assert ids or prefills, "a step with neither rows nor prefills"
    lean.refresh()
    n, sizes = len(ids), [chunk.ids.shape[1] for _, chunk in prefills]
    total = n + sum(sizes)
    g, d, hkv, hq = lean.group, lean.head_dim, lean.num_kv_heads, lean.num_heads
    device, dtype = batch.device, batch.dtype
    row_mask = _begin_step(batch, n) if n else None  # [n, 1, 1, span]
    attends = [_chunk_attention(cache, chunk, g, dtype, device) for cache, chunk in prefills]
    # the rows' tokens then each chunk's, as one sequence through the linear maps
    tokens = torch.cat([torch.tensor(ids, dtype=torch.long, device=device), *(c.ids[0] for _, c in prefills)])[None]
    at = torch.cat([torch.tensor(positions, dtype=torch.long, device=device),
                    *(c.positions[0] for _, c in prefills)])[None]  # [1, total]
    x = lean.embed(tokens)  # [1, total, E]
    cos, sin = lean.rotary(x, at)
    for i, (layer, row_kv) in enumerate(zip(lean.layers, batch.cache.layers)):
        q, k, v = lean.qkv[i](layer.input_layernorm(x))
        q = q.view(1, total, hq, d).transpose(1, 2)  # [1, Hq, total, D]
        k = k.view(1, total, hkv, d).transpose(1, 2)  # [1, Hkv, total, D]
        v = v.view(1, total, hkv, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        outs = []
        if n:  # the rows: one token each, [n, H, 1, D], against their rows of the batch cache
            keys, values = row_kv.update(k[0, :, :n, None].transpose(0, 1), v[0, :, :n, None].transpose(0, 1))
            qr = q[0, :, :n].transpose(0, 1).reshape(n, hkv, g, d)  # q heads sharing a KV head folded into rows
            rows = F.scaled_dot_product_attention(qr, keys, values, attn_mask=row_mask, scale=lean.scale)
            outs.append(rows.reshape(n, hq * d))
        a = n
        for (cache, _), m, (visible, fused, folded_mask) in zip(prefills, sizes, attends):
            # a chunk: [1, H, m, D] against its own cache
            keys, values = cache.layers[i].update(k[:, :, a : a + m], v[:, :, a : a + m])
            qc = q[:, :, a : a + m].reshape(1, hkv, g * m, d)
            out = attention.prefill_attention(qc, keys, values, m, lean.scale, visible) if fused else None
            if out is None:
                out = F.scaled_dot_product_attention(qc, keys, values, attn_mask=folded_mask, scale=lean.scale)
            outs.append(out.reshape(hq, m, d).transpose(0, 1).reshape(m, hq * d))
            a += m
        x = x + lean.o[i](torch.cat(outs)[None])[0]
        x = x + lean.mlp(i, layer, x)
    ends = [n + sum(sizes[: j + 1]) - 1 for j in range(len(sizes))]
    logits = lean.head(lean.norm(x[:, [*range(n), *ends]]))[0][0].float()  # [n + len(prefills), V]
    for r in range(n):
        batch.lengths[r] += 1
    return logits[:n], list(logits[n:])


def _chunk_attention(cache: DynamicCache, chunk: Chunk, g: int, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor | None, bool, torch.Tensor]:
    """How a chunk's attention runs: (the fused kernel's visible prefixes, whether it runs, the SDPA
    mask per folded query row [1, 1, g * m, cached + m])."""
    m = chunk.ids.shape[1]
    num_cached = cache.layers[0].length  # before the chunk
    # the fused kernel where it reads the mask (engine/compute/attention.py), else SDPA
    fused = attention.available(dtype, device) and m > 1
    visible = None
    if fused and chunk.mask is not None:
        visible = attention.visible_prefixes(chunk.mask, num_cached)
        fused = visible is not None
    mask = chunk.mask
    if mask is None:
        col = torch.arange(num_cached + m, device=device)[None, :]
        mask = torch.zeros(m, num_cached + m, dtype=dtype, device=device)
        mask.masked_fill_(col > num_cached + torch.arange(m, device=device)[:, None], torch.finfo(dtype).min)
        mask = mask[None, None]
    return visible, fused, mask.to(dtype).repeat(1, 1, g, 1)
