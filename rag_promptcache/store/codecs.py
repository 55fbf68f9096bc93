"""KV codecs: how a module's K and V tensors are laid out at rest, and back.

- "native": the model's own dtype, bit for bit.
- "fp16", "bf16": casts; decoded back to the original dtype.
- "int8", "int4": asymmetric round-to-nearest as in KIVI: keys per channel (min/max over tokens, so
  the outlier channels of post-RoPE keys get their own range), values per token (min/max over
  head_dim). Scale and zero point are kept in fp16 (fp32 if the range overflows fp16). int4 packs two
  codes per byte along head_dim.
- "k8v4": keys as int8, values as int4 (the same axes): keys decide which tokens a question reads
  (their error passes through the softmax), values only what is read, and measured here keys carry the
  outlier channels while values do not (docs/stores.md, "Choosing the cachegen codec"). 0.4 of fp16.
- "k6v6", "k7v5", "k5v5": the same layout with 6, 7 or 5-bit codes, packed eight codes to `bits` bytes
  along head_dim: k6v6 and k7v5 cost what k8v4 costs and spend its bits evenly; k5v5 is 0.33 of fp16.
- "cachegen": a step per channel's deviation and per layer, entropy-coded (cachegen.py).

Each codec carries a version, written into every serialized entry: an entry of a codec version this
code does not know is a miss, never decoded wrongly.

Out of scope: fp8, per-group key quantization, residual fp16 windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cachegen
from .base import ModuleKV
from .cachegen import CodecError

__all__ = ["CODECS", "CODEC_VERSIONS", "CODEC_WARNINGS", "CodecError", "EncodedKV", "bytes_per_token", "check_codec", "decode", "encode",
           "layout"]

CODEC_VERSIONS: dict[str, int] = {"native": 1, "fp16": 1, "bf16": 1, "int8": 1, "int4": 1, "cachegen": 2, "k8v4": 1,
                                   "k6v6": 1, "k7v5": 1, "k5v5": 1}
CODECS: tuple[str, ...] = tuple(CODEC_VERSIONS)
# Codecs not shown to keep answers against fp16 modules on the default model (docs/stores.md, "Codecs and
# answers"): what a corpus that chooses one is warned of.
CODEC_WARNINGS: dict[str, str] = {
    "int4": "is not shown to keep answers: over modules read back from int4 the tuned model kept 0.69-0.86 of "
            "fp16 modules' right answers in five of six fidelity cells (docs/stores.md, \"Codecs and answers\"); "
            "check it on your questions with `rag-promptcache eval QUESTIONS --corpus CORPUS --codec int4`",
    "k8v4": "is not shown to keep answers: over modules read back from k8v4 the tuned model kept 0.92 of fp16 "
            "modules' right answers on the manuals split at k = 8 (two draws; docs/stores.md, \"Codecs and answers\"); "
            "check it on your questions with `rag-promptcache eval QUESTIONS --corpus CORPUS --codec k8v4`",
    "k5v5": "is not shown to keep answers as int8 and k6v6 do: over modules read back from k5v5 the tuned model kept "
            "0.87 of fp16 modules' right answers on the manuals split at k = 4 and 8 in one of two draws (docs/stores.md, "
            "\"Codecs and answers\"); "
            "check it on your questions with `rag-promptcache eval QUESTIONS --corpus CORPUS --codec k5v5`",
    "cachegen": "is not shown to keep answers: over modules read back from cachegen the tuned model kept 0.54-0.74 "
                "of fp16 modules' right answers in the fidelity cells (docs/stores.md, \"Codecs and answers\"); "
                "check it on your questions with `rag-promptcache eval QUESTIONS --corpus CORPUS --codec cachegen`",
}
_CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
_BITS = {"int8": (8, 8), "int4": (4, 4), "k8v4": (8, 4), "k6v6": (6, 6), "k7v5": (7, 5), "k5v5": (5, 5)}  # (keys, values)
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
}


def check_codec(name: str) -> str:
    if name not in CODEC_VERSIONS:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(CODECS)}")
    return name


@dataclass(frozen=True, slots=True)
class EncodedKV:
    """A `ModuleKV` in a codec's at-rest form. `tensors` holds the payload only (no metadata)."""

    tensors: dict[str, torch.Tensor]
    codec: str
    dtype: torch.dtype  # of the original keys/values
    shape: tuple[int, int, int, int]  # [layers, kv_heads, tokens, head_dim]
    start: int
    token_ids: tuple[int, ...]
    fingerprint: str
    mode: str

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def layout(codec: str, shape: tuple[int, int, int, int], start: int = 0) -> dict[str, tuple[int, ...] | None]:
    """The tensor names and shapes a codec produces for KV of `shape` encoded from position `start`;
    used to validate loads. None: a one-dimensional tensor of any length (a coded stream)."""
    L, H, S, D = shape
    if codec == "cachegen":
        return cachegen.layout(shape, start)
    if codec in ("native", "fp16", "bf16"):
        return {"k": shape, "v": shape}
    kw, vw = (_packed_width(D, bits) for bits in _BITS[codec])
    return {
        "k": (L, H, S, kw),
        "v": (L, H, S, vw),
        "k_scale": (L, H, 1, D),
        "k_zero": (L, H, 1, D),
        "v_scale": (L, H, S, 1),
        "v_zero": (L, H, S, 1),
    }


def bytes_per_token(codec: str, geometry: tuple[int, int, int], dtype: torch.dtype, module_tokens: int = 256) -> float:
    """About what one token of KV costs at rest in `codec`, for a model of `geometry` (layers, KV heads,
    head_dim) whose KV is `dtype`, in modules of about `module_tokens` tokens (the per-channel
    parameters of a module are spread over its tokens). The fixed-width codecs' formula; for
    "cachegen", its rate on SmolLM2's KV (`cachegen.bits_per_element`)."""
    L, H, D = geometry
    elements = 2 * L * H * D  # keys and values
    check_codec(codec)
    if codec == "native":
        return elements * dtype.itemsize
    if codec in _CASTS:
        return elements * 2
    if codec == "cachegen":
        return elements * cachegen.bits_per_element(geometry) / 8
    codes = elements * sum(_BITS[codec]) // 16
    # fp16 scale and zero: keys per channel (per module), values per token
    return codes + 2 * 2 * L * H * D / max(module_tokens, 1) + 2 * 2 * L * H


def _packed_width(head_dim: int, bits: int) -> int:
    if bits == 8:
        return head_dim
    if bits == 4:
        return (head_dim + 1) // 2
    return (head_dim + 7) // 8 * bits


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """`bits`-bit codes along the last dim into bytes, little-endian: 4 bits two to a byte, low nibble
    first; 5-7 bits eight codes to `bits` bytes (padded to a multiple of eight codes)."""
    if bits == 8:
        return q
    if bits == 4:
        if q.shape[-1] % 2:
            q = torch.nn.functional.pad(q, (0, 1))
        return q[..., 0::2] | (q[..., 1::2] << 4)
    q = torch.nn.functional.pad(q, (0, -q.shape[-1] % 8)).to(torch.int64)
    q = q.unflatten(-1, (-1, 8))
    word = (q << (bits * torch.arange(8, device=q.device))).sum(-1, keepdim=True)  # 8 codes in the low 8 * bits bits
    return ((word >> (8 * torch.arange(bits, device=q.device))) & 0xFF).to(torch.uint8).flatten(-2)


def _unpack(q: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    if bits == 8:
        return q
    if bits == 4:
        return torch.stack((q & 0xF, q >> 4), dim=-1).flatten(-2)[..., :head_dim]
    if bits == 6:  # four codes in three bytes, in uint8 ops: 2.3x sooner than the int64 words below
        b0, b1, b2 = q.unflatten(-1, (-1, 3)).unbind(-1)
        return torch.stack((b0 & 63, (b0 >> 6) | ((b1 & 15) << 2), (b1 >> 4) | ((b2 & 3) << 4), b2 >> 2), -1).flatten(-2)[..., :head_dim]
    word = (q.unflatten(-1, (-1, bits)).to(torch.int64) << (8 * torch.arange(bits, device=q.device))).sum(-1, keepdim=True)
    return ((word >> (bits * torch.arange(8, device=q.device))) & (2**bits - 1)).flatten(-2)[..., :head_dim]


def _quantize(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    qmax = 2**bits - 1
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    fits_fp16 = max(lo.abs().max().item(), hi.abs().max().item()) < 6.0e4 if xf.numel() else True
    param_dtype = torch.float16 if fits_fp16 else torch.float32
    # Quantize against the rounded parameters so decode sees exactly what encode assumed.
    scale = ((hi - lo) / qmax).clamp_min(1e-4).to(param_dtype)
    zero = lo.to(param_dtype)
    q = ((xf - zero.float()) / scale.float()).round_().clamp_(0, qmax).to(torch.uint8)
    return _pack(q, bits).contiguous(), scale.contiguous(), zero.contiguous()


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    return _unpack(q, bits, head_dim).float() * scale.float() + zero.float()


def _native_dequantize(enc: EncodedKV, dtype: torch.dtype, device: torch.device | str | None
                       ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(keys, values) decoded by the native kernel (model/kernels/dequantize.c: the torch path's arithmetic
    in one pass), or None where it does not run: not bf16 out, not on CPU, or no kernels here."""
    t = enc.tensors
    if dtype != torch.bfloat16 or any(x.device.type != "cpu" for x in t.values()) or torch.device(device or "cpu").type != "cpu":
        return None
    from rag_promptcache.model import native  # not at the top: the store imports no model code until it decodes

    lib = native.library()
    if lib is None:
        return None
    L, H, S, D = enc.shape
    out = []
    for name, bits, per_token in (("k", _BITS[enc.codec][0], 0), ("v", _BITS[enc.codec][1], 1)):
        codes = t[name].contiguous()
        scale, zero = (t[f"{name}_{p}"].float().contiguous() for p in ("scale", "zero"))
        x = torch.empty(L, H, S, D, dtype=torch.bfloat16)
        rc = lib.dequantize_bf16(codes.data_ptr(), L * H, S, D, codes.shape[-1], bits, scale.data_ptr(), zero.data_ptr(),
                                 per_token, x.data_ptr(), torch.get_num_threads())
        if rc != 0:
            return None
        out.append(x)
    return out[0], out[1]


def encode(kv: ModuleKV, codec: str = "native", device: torch.device | str = "cpu", pin: bool = False) -> EncodedKV:
    """Encode into fresh tensors on `device` (never views of the caller's tensors)."""
    check_codec(codec)
    if kv.keys.dtype not in DTYPES.values():
        raise ValueError(f"unsupported KV dtype {kv.keys.dtype}; valid dtypes: {', '.join(DTYPES)}")
    keys, values = kv.keys.detach(), kv.values.detach()
    device = torch.device(device)
    if codec in ("native", "fp16", "bf16"):
        # copy=True: the store must never alias the caller's (possibly sliced, later mutated) tensors.
        dtype = _CASTS.get(codec, keys.dtype)
        tensors = {n: x.to(device=device, dtype=dtype, copy=True).contiguous() for n, x in (("k", keys), ("v", values))}
    elif codec == "cachegen":
        tensors = {n: x.to(device) for n, x in cachegen.encode(keys.cpu(), values.cpu(), kv.start).items()}
    else:
        kbits, vbits = _BITS[codec]
        k, k_scale, k_zero = _quantize(keys, dim=2, bits=kbits)  # per channel: range over tokens
        v, v_scale, v_zero = _quantize(values, dim=3, bits=vbits)  # per token: range over head_dim
        tensors = {"k": k, "v": v, "k_scale": k_scale, "k_zero": k_zero, "v_scale": v_scale, "v_zero": v_zero}
        tensors = {n: x.to(device) for n, x in tensors.items()}
    if pin:
        tensors = {n: x.pin_memory() for n, x in tensors.items()}
    L, H, S, D = keys.shape
    return EncodedKV(tensors, codec, keys.dtype, (L, H, S, D), kv.start, tuple(kv.token_ids), kv.fingerprint, kv.mode)


def decode(enc: EncodedKV, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> ModuleKV:
    """Back to a `ModuleKV` in the original dtype (or `dtype`) on the tensors' device (or `device`).

    For "native" on the same device the returned tensors are the stored ones: treat them as read-only.
    Raises `CodecError` for a coded stream that does not decode to the header's shape.
    """
    dtype = dtype or enc.dtype
    t = enc.tensors
    if enc.codec in ("native", "fp16", "bf16"):
        keys, values = t["k"], t["v"]
    elif enc.codec == "cachegen":
        keys, values = cachegen.decode({n: x.cpu() for n, x in t.items()}, enc.shape, enc.start)
        device = device or next(iter(t.values())).device
    else:
        (kbits, vbits), D = _BITS[enc.codec], enc.shape[3]
        native = _native_dequantize(enc, dtype, device)  # bf16 on CPU already: the casts below return them as they are
        if native is not None:
            keys, values = native
        else:
            keys = _dequantize(t["k"], t["k_scale"], t["k_zero"], kbits, D)
            values = _dequantize(t["v"], t["v_scale"], t["v_zero"], vbits, D)
    # keys, values: [layers, kv_heads, tokens, head_dim]
    keys = keys.to(device=device, dtype=dtype)
    values = values.to(device=device, dtype=dtype)
    return ModuleKV(keys, values, enc.start, enc.token_ids, enc.fingerprint, enc.mode)
