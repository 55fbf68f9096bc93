"""The "cachegen" codec: module KV quantized with a step per channel and a bit width per layer, then
entropy-coded (rANS, `constriction`), as CacheGen (Liu et al., SIGCOMM 2024) codes KV, without its
deltas between neighbouring tokens.

For each layer, K or V, KV head and channel, over the module's tokens:
- the channel's mean (fp16) and its step (one byte, `step_code`) are kept;
- every value is stored as its distance from the mean in steps of `STEP[layer] * deviation`, rounded
  and clipped to `SYMBOLS` symbols (a few deviations either side);
- the symbols are coded with rANS, one frequency table per layer and K/V, kept in the entry.

Why this shape, measured on SmolLM2-135M's own module KV (docs/stores.md, "Choosing the codec"):
- Deltas from an anchor token (the codec's first version) were no smaller than the spread around the
  channel mean: this model's values barely correlate from one token to the next.
- KIVI's min/max groups (keys per channel, values per token) at 2 and 3 bits spend their levels on each
  group's extremes; at the same bytes a step relative to the channel's deviation, entropy-coded, has
  well under half their value error, because most values sit near the mean and cost few bits there.
- Layers differ in what an error costs the answers: `STEP` is finer where coarse steps lost answers.

Decoding is one coder call per layer and K/V and whole-array numpy (not torch, whose thread pool
turned a few milliseconds into hundreds on a busy machine).

Out of scope: tables profiled offline per model, levels chosen per chunk while streaming, GPU decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# The step of each layer, in deviations of its channel, over the layers' depth: (from this fraction of
# the layers on, this step). Coarser steps cost fewer bits and more error.
STEP: tuple[tuple[float, float], ...] = ((0.0, 0.7),)
SYMBOLS = 33  # odd: the mean is a symbol; values past +-16 steps are clipped
TABLE_MAX = 2**16 - 1
BITS_PER_ELEMENT = 2.6  # what one value costs on SmolLM2's KV, tables and parameters included (estimates)


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
    """KV of shape [layers, kv_heads, tokens, head_dim]."""

    layers: int
    heads: int
    tokens: int
    head_dim: int

    def steps(self) -> np.ndarray:
        """[layers] the step of each layer, in deviations."""
        out = np.empty(self.layers, dtype=np.float32)
        for i in range(self.layers):
            depth = i / max(self.layers, 1)
            out[i] = [s for start, s in STEP if depth >= start][-1]
        return out


def bits_per_element(geometry: tuple[int, int, int]) -> float:
    """The expected cost of one value, for size estimates (the measured rate; it varies with the KV)."""
    return BITS_PER_ELEMENT


def layout(shape: tuple[int, int, int, int], start: int) -> dict[str, tuple[int, ...] | None]:
    """Tensor names and shapes of a coded entry; None for the stream, whose length varies."""
    L, H, S, D = shape
    if not S:
        return {"stream": None}
    sink = {"sink": (2, L, H, 1, D)} if _keeps_sink(S, start) else {}
    return {"stream": None, "tables": (2, L, SYMBOLS), "mean": (2, L, H, 1, D), "step": (2, L, H, 1, D), **sink}


def _keeps_sink(tokens: int, start: int) -> bool:
    """The token at position 0 (the attention sink every later token attends to) is kept in fp16."""
    return start == 0 and tokens > 1


def _table(symbols: np.ndarray) -> np.ndarray:
    """Symbol counts scaled into uint16 (every symbol that occurs keeps a nonzero count)."""
    counts = np.bincount(symbols, minlength=SYMBOLS).astype(np.float64)
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


def step_code(step: torch.Tensor) -> torch.Tensor:
    """A step as one byte: its log2 in eighths of an octave (a step is kept within 9% of itself, which
    only changes how finely a channel is cut, not where: decoding uses the same rounded step)."""
    return (torch.log2(step.clamp_min(STEP_MIN)) * 8 + 128).round_().clamp_(0, 255).to(torch.uint8)


def step_of(code: np.ndarray) -> np.ndarray:
    return np.exp2((code.astype(np.float32) - 128) / 8)


STEP_MIN = 2.0**-16


def quantize(x: torch.Tensor, g: Geometry) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
    """x: [L, H, S, D] -> symbols [L, H, S, D] (int32, 0 .. SYMBOLS - 1) and the per-channel mean (fp16)
    and step (`step_code`), as stored."""
    x = x.float()
    mean = x.mean(dim=2, keepdim=True).half()
    sd = x.std(dim=2, keepdim=True, correction=0).nan_to_num(0.0)
    code = step_code(sd * torch.from_numpy(g.steps()).view(-1, 1, 1, 1))
    step = torch.from_numpy(step_of(code.numpy()))
    half = SYMBOLS // 2
    sym = ((x - mean.float()) / step).round_().clamp_(-half, half) + half
    return sym.to(torch.int32).numpy(), {"mean": mean, "step": code}


def dequantize(sym: np.ndarray, mean: torch.Tensor, code: torch.Tensor) -> np.ndarray:
    """sym: [H, S, D] integer symbols of one layer; mean, step code: [H, 1, D] -> [H, S, D] float32."""
    return (sym.astype(np.float32) - SYMBOLS // 2) * step_of(code.numpy()) + mean.float().numpy()


def encode(keys: torch.Tensor, values: torch.Tensor, start: int) -> dict[str, torch.Tensor]:
    """keys, values: [L, H, S, D] encoded from position `start` -> the tensors of a coded entry."""
    L, H, S, D = keys.shape
    if not S:
        return {"stream": torch.zeros(0, dtype=torch.uint8)}
    constriction = _require()
    sink = {}
    if _keeps_sink(S, start):
        sink = {"sink": torch.stack([keys[:, :, :1], values[:, :, :1]]).half()}
        keys, values, S = keys[:, :, 1:], values[:, :, 1:], S - 1
    g = Geometry(L, H, S, D)
    tables = np.zeros((2, L, SYMBOLS), dtype=np.uint16)
    params: dict[str, list[torch.Tensor]] = {"mean": [], "step": []}
    segments: list[tuple[np.ndarray, np.ndarray]] = []  # in decode order
    for kv, x in enumerate((keys, values)):
        sym, p = quantize(x, g)
        for name, t in p.items():
            params[name].append(t)
        for i in range(L):
            flat = sym[i].reshape(-1)
            tables[kv, i] = _table(flat)
            segments.append((flat, tables[kv, i]))
    coder = constriction.stream.stack.AnsCoder()
    for symbols, table in reversed(segments):
        coder.encode_reverse(symbols, _model(table))
    stream = coder.get_compressed().astype("<u4").view(np.uint8)
    out = {"stream": torch.from_numpy(stream.copy()), "tables": torch.from_numpy(tables.view(np.int16).copy()), **sink}
    out.update({name: torch.stack(ts) for name, ts in params.items()})
    return out


def decode(t: dict[str, torch.Tensor], shape: tuple[int, int, int, int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors of a coded entry -> (keys, values) in float32; raises `CodecError`."""
    L, H, S, D = shape
    if not S:
        empty = torch.zeros(shape)
        return empty, empty.clone()
    first = int(_keeps_sink(S, start))
    S -= first
    constriction = _require()
    raw = t["stream"].numpy()
    if raw.size % 4:
        raise CodecError(f"stream of {raw.size} bytes is not whole 32-bit words")
    coder = constriction.stream.stack.AnsCoder(raw.view("<u4").astype(np.uint32))
    tables = t["tables"].numpy().view(np.uint16)
    out = np.empty((2, L, H, first + S, D), dtype=np.float32)
    if first:
        out[:, :, :, :1] = t["sink"].float().numpy()
    for kv in range(2):
        for i in range(L):
            sym = coder.decode(_model(tables[kv, i]), H * S * D).reshape(H, S, D)
            out[kv, i, :, first:] = dequantize(sym, t["mean"][kv, i], t["step"][kv, i])
    if not coder.is_empty():
        raise CodecError("stream has bytes left after every symbol was decoded")
    return torch.from_numpy(out[0]), torch.from_numpy(out[1])
