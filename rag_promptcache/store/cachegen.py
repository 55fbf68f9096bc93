"""The CacheGen codec (Liu et al., SIGCOMM 2024): KV as deltas from anchor tokens, quantized with a
bit width per layer group, then entropy-coded.

For each layer, KV head and channel:
- tokens form groups of `GROUP` consecutive tokens; the first of each group is its anchor;
- one step per channel, set from the spread of the channel's deltas and its layer group's bit width
  (early, middle and late thirds of the layers; later layers tolerate coarser values, as the paper
  measured);
- anchors are stored as their difference from the channel's mean, in steps (256 symbols);
- every other token is stored as its difference from its group's *dequantized* anchor, in steps;
- the symbols are coded with rANS (`constriction`), one frequency table per layer and K/V for the
  deltas and one per K/V for the anchors, stored in the entry.

Coding against one anchor (not the previous token) keeps errors from accumulating and lets decode
run as whole-tensor operations: the coder returns every symbol of a segment in one call.

Out of scope: frequency tables profiled offline per model (the paper's), levels chosen per chunk
while streaming, and GPU decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 10
# Bit widths of the early, middle and late thirds of the layers: width b quantizes with a step of
# 2^(3-b) standard deviations of the channel's deltas (b bits would span +-4 deviations); the
# alphabet is 4x wider so that outlier tokens are coded, at a few bits more, instead of clipped.
LAYER_BITS = (4, 3, 3)
ANCHOR_SYMBOLS = 256
TABLE_MAX = 2**16 - 1


class CodecError(ValueError):
    """A coded payload that does not decode to what its header promises."""


def _require():
    try:
        import constriction
    except ImportError as e:
        raise ImportError("the cachegen codec needs constriction: pip install 'rag-promptcache[store]'") from e
    return constriction


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where anchors and deltas sit for KV of shape [layers, kv_heads, tokens, head_dim]."""

    layers: int
    heads: int
    tokens: int
    head_dim: int

    @property
    def num_anchors(self) -> int:
        return -(-self.tokens // GROUP)

    @property
    def num_deltas(self) -> int:
        return self.tokens - self.num_anchors

    def layer_bits(self) -> list[int]:
        thirds = [min(len(LAYER_BITS) - 1, (i * len(LAYER_BITS)) // max(self.layers, 1)) for i in range(self.layers)]
        return [LAYER_BITS[t] for t in thirds]


def layout(shape: tuple[int, int, int, int]) -> dict[str, tuple[int, ...] | None]:
    """Tensor names and shapes of a coded entry; None for the stream, whose length varies."""
    L, H, S, D = shape
    A = -(-S // GROUP)
    return {
        "stream": None,
        "anchor_table": (2, ANCHOR_SYMBOLS),
        "delta_tables": (2, L, _WIDTH),
        "mean": (2, L, H, 1, D),
        "step": (2, L, H, 1, D),
    } if A else {"stream": None}


def _is_anchor(tokens: int) -> torch.Tensor:
    mask = torch.zeros(tokens, dtype=torch.bool)
    mask[::GROUP] = True
    return mask


def _table(symbols: np.ndarray, size: int) -> np.ndarray:
    """Symbol counts scaled into uint16 (every symbol that occurs keeps a nonzero count)."""
    counts = np.bincount(symbols, minlength=size).astype(np.float64)
    if counts.max() > TABLE_MAX:
        scaled = np.ceil(counts * (TABLE_MAX / counts.max()))
        counts = np.where(counts > 0, np.maximum(scaled, 1), 0)
    return counts.astype(np.uint16)


def _model(table: np.ndarray):
    constriction = _require()
    probs = table.astype(np.float64)
    if not probs.any():
        probs[0] = 1.0
    return constriction.stream.model.Categorical(probs, perfect=False)


def _alphabet(bits: int) -> int:
    return 2 ** (bits + 2)


_WIDTH = max(_alphabet(b) for b in LAYER_BITS)


def _offsets(g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer: the step in deviations and the symbol of a zero delta. [L, 1, 1, 1] each."""
    rel = torch.tensor([2.0 ** (3 - b) for b in g.layer_bits()]).view(-1, 1, 1, 1)
    zero = torch.tensor([_alphabet(b) // 2 - 1 for b in g.layer_bits()], dtype=torch.float32).view(-1, 1, 1, 1)
    return rel, zero


def quantize(x: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """x: [L, H, S, D] -> anchor symbols [L, H, A, D], delta symbols [L, H, S - A, D] (int32) and
    the per-channel mean and step (fp16, as stored)."""
    x = x.float()
    mask = _is_anchor(g.tokens)
    mean = x.mean(dim=2, keepdim=True).half()
    rel, zero = _offsets(g)
    spread = x[:, :, ~mask] - x[:, :, mask][:, :, torch.arange(g.tokens)[~mask] // GROUP]
    sd = (spread if g.num_deltas else x).std(dim=2, keepdim=True, correction=0)
    step = (sd.nan_to_num(0.0) * rel).clamp_min(1e-4).half()
    stepf = step.float()
    half_anchor = ANCHOR_SYMBOLS // 2 - 1
    a_sym = ((x[:, :, mask] - mean.float()) / stepf).round_().clamp_(-half_anchor, half_anchor)
    a_hat = a_sym * stepf + mean.float()
    owner = torch.arange(g.tokens)[~mask] // GROUP
    d_sym = ((x[:, :, ~mask] - a_hat[:, :, owner]) / stepf).round_().clamp_(-zero, zero)
    return (a_sym + half_anchor).to(torch.int32), (d_sym + zero).to(torch.int32), {"mean": mean, "step": step}


def dequantize(a_sym: np.ndarray, d_sym: np.ndarray, params: dict[str, torch.Tensor], g: Geometry) -> torch.Tensor:
    """a_sym: [L, H, A, D], d_sym: [L, H, S - A, D] integer symbols -> [L, H, S, D] float32.

    In numpy: whole-array operations of a few milliseconds, which torch's thread pool turns into
    hundreds when the cores are busy.
    """
    step = params["step"].float().numpy()
    a_hat = (a_sym.astype(np.float32) - (ANCHOR_SYMBOLS // 2 - 1)) * step + params["mean"].float().numpy()
    zero = _offsets(g)[1].numpy()
    out = np.zeros((g.layers, g.heads, g.num_anchors * GROUP, g.head_dim), dtype=np.float32)
    # deltas land in their token slots, then every group adds its anchor
    slots = np.flatnonzero(~_is_anchor(g.tokens).numpy())
    out[:, :, slots] = (d_sym.astype(np.float32) - zero) * step
    out.reshape(g.layers, g.heads, g.num_anchors, GROUP, g.head_dim)[...] += a_hat[:, :, :, None]
    return torch.from_numpy(out[:, :, : g.tokens])


def encode(keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """keys, values: [L, H, S, D] -> the tensors of a coded entry."""
    L, H, S, D = keys.shape
    g = Geometry(L, H, S, D)
    if not g.num_anchors:
        return {"stream": torch.zeros(0, dtype=torch.uint8)}
    constriction = _require()
    anchor_table = np.zeros((2, ANCHOR_SYMBOLS), dtype=np.uint16)
    tables = np.zeros((2, L, _WIDTH), dtype=np.uint16)
    params: dict[str, list[torch.Tensor]] = {"mean": [], "step": []}
    segments: list[tuple[np.ndarray, np.ndarray]] = []  # in decode order
    for kv, x in enumerate((keys, values)):
        a_sym, d_sym, p = quantize(x, g)
        for name, t in p.items():
            params[name].append(t)
        anchors = a_sym.numpy().reshape(-1)
        anchor_table[kv] = _table(anchors, ANCHOR_SYMBOLS)
        segments.append((anchors, anchor_table[kv]))
        for i, bits in enumerate(g.layer_bits()):
            d = d_sym[i].numpy().reshape(-1)
            tables[kv, i, : _alphabet(bits)] = _table(d, _alphabet(bits))
            segments.append((d, tables[kv, i, : _alphabet(bits)]))
    coder = constriction.stream.stack.AnsCoder()
    for symbols, table in reversed(segments):
        if symbols.size:
            coder.encode_reverse(symbols, _model(table))
    stream = coder.get_compressed().astype("<u4").view(np.uint8)
    out = {"stream": torch.from_numpy(stream.copy()),
           "anchor_table": torch.from_numpy(anchor_table.view(np.int16).copy()),
           "delta_tables": torch.from_numpy(tables.view(np.int16).copy())}
    out.update({name: torch.stack(ts) for name, ts in params.items()})
    return out


def decode(t: dict[str, torch.Tensor], shape: tuple[int, int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors of a coded entry -> (keys, values) in float32; raises `CodecError`."""
    L, H, S, D = shape
    g = Geometry(L, H, S, D)
    if not g.num_anchors:
        empty = torch.zeros(shape)
        return empty, empty.clone()
    constriction = _require()
    raw = t["stream"].numpy()
    if raw.size % 4:
        raise CodecError(f"stream of {raw.size} bytes is not whole 32-bit words")
    coder = constriction.stream.stack.AnsCoder(raw.view("<u4").astype(np.uint32))
    anchor_table = t["anchor_table"].numpy().view(np.uint16)
    tables = t["delta_tables"].numpy().view(np.uint16)
    per_layer_delta = H * g.num_deltas * D
    out = []
    for kv in range(2):
        anchors = coder.decode(_model(anchor_table[kv]), L * H * g.num_anchors * D)
        deltas = [coder.decode(_model(tables[kv, i, : _alphabet(b)]), per_layer_delta) if per_layer_delta
                  else np.zeros(0, np.int32) for i, b in enumerate(g.layer_bits())]
        a_sym = anchors.reshape(L, H, g.num_anchors, D)
        d_sym = np.concatenate(deltas).reshape(L, H, g.num_deltas, D)
        out.append(dequantize(a_sym, d_sym, {"mean": t["mean"][kv], "step": t["step"][kv]}, g))
    if not coder.is_empty():
        raise CodecError("stream has bytes left after every symbol was decoded")
    return out[0], out[1]
