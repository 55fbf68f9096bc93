"""An encoded entry <-> safetensors bytes or file, with a versioned, checksummed header.

The header (safetensors metadata, all strings) records: format and version, the key the entry was
written under, model fingerprint, encoding mode, original dtype, shape, codec and codec version,
start, token ids (base64 of little-endian ints) and a CRC-32 checksum over the rest of the header
and every tensor's bytes. Loading checks all of it: anything off raises `CorruptEntry`, which tiers
turn into a miss. Keys are content addresses, so a file whose header names another key (another
model, mode or text) under our name is corruption, not a hit.

Out of scope: where the bytes live (the tiers) and choosing a codec (codecs.py).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import mmap
import os
import zlib

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .base import FORMAT_VERSION
from .codecs import CODEC_VERSIONS, DTYPES, EncodedKV, layout

MAGIC = "rag-promptcache-kv"
_LOAD_ERRORS = (SafetensorError, ValueError, KeyError, RuntimeError, TypeError, OSError)


class CorruptEntry(ValueError):
    """A stored entry that cannot be trusted (truncated, altered, foreign, or of an unknown version)."""


class WarnOnce:
    """Logs a warning once per key: a cache that keeps hitting one bad entry must not flood the log."""

    def __init__(self, logger: logging.Logger, limit: int = 10_000) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self._limit = limit

    def __call__(self, key: str, msg: str, *args: object) -> None:
        if key in self._seen or len(self._seen) >= self._limit:
            return
        self._seen.add(key)
        self._logger.warning(msg, *args)


def _checksum(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    # CRC-32 catches truncation and flipped bytes at about 2 GB/s (blake2b: 0.6 GB/s, a third of a
    # disk hit's time). It is not a defence against forgery; foreign entries are caught by the key
    # recorded in the header.
    crc = zlib.crc32(json.dumps({k: v for k, v in meta.items() if k != "checksum"}, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode(), crc)
        if t.numel():
            crc = zlib.crc32(t.view(-1).view(torch.uint8).numpy(), crc)
    return f"{crc:08x}"


def _pack_ids(token_ids: tuple[int, ...]) -> tuple[str, str]:
    small = all(0 <= i < 2**31 for i in token_ids)
    dtype = "<i4" if small else "<i8"
    return dtype, base64.b64encode(np.asarray(token_ids, dtype=dtype).tobytes()).decode()


def header(key: str, enc: EncodedKV) -> dict[str, str]:
    L, H, S, D = enc.shape
    ids_dtype, ids = _pack_ids(enc.token_ids)
    meta = {
        "format": MAGIC,
        "format_version": str(FORMAT_VERSION),
        "key": key,
        "fingerprint": enc.fingerprint,
        "mode": enc.mode,
        "dtype": str(enc.dtype).removeprefix("torch."),
        "num_layers": str(L),
        "num_kv_heads": str(H),
        "num_tokens": str(S),
        "head_dim": str(D),
        "codec": enc.codec,
        "codec_version": str(CODEC_VERSIONS[enc.codec]),
        "start": str(enc.start),
        "token_ids_dtype": ids_dtype,
        "token_ids": ids,
    }
    return meta


def dumps(key: str, enc: EncodedKV) -> bytes:
    tensors = {n: t.detach().cpu().contiguous() for n, t in enc.tensors.items()}
    meta = header(key, enc)
    meta["checksum"] = _checksum(meta, tensors)
    return st_save(tensors, metadata=meta)


def _check(key: str, meta: dict[str, str] | None, tensors: dict[str, torch.Tensor]) -> EncodedKV:
    if not meta or meta.get("format") != MAGIC:
        raise CorruptEntry(f"not a {MAGIC} entry")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise CorruptEntry(f"format version {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}")
    if meta["key"] != key:
        raise CorruptEntry(f"entry was written for key {meta['key']} (model {meta.get('fingerprint')!r})")
    codec = meta["codec"]
    if codec not in CODEC_VERSIONS or meta["codec_version"] != str(CODEC_VERSIONS[codec]):
        raise CorruptEntry(f"codec {codec!r} v{meta['codec_version']} is not one this code decodes")
    if meta["dtype"] not in DTYPES:
        raise CorruptEntry(f"dtype {meta['dtype']!r}")
    shape = (int(meta["num_layers"]), int(meta["num_kv_heads"]), int(meta["num_tokens"]), int(meta["head_dim"]))
    expected = layout(codec, shape, int(meta["start"]))
    got = {n: tuple(t.shape) if expected.get(n) is not None else len(t.shape) for n, t in tensors.items()}
    if got != {n: 1 if s is None else s for n, s in expected.items()}:
        raise CorruptEntry(f"tensors {got}, expected {expected}")
    if _checksum(meta, tensors) != meta["checksum"]:
        raise CorruptEntry("checksum mismatch")
    ids_dtype = meta["token_ids_dtype"]
    if ids_dtype not in ("<i4", "<i8"):
        raise CorruptEntry(f"token id dtype {ids_dtype!r}")
    token_ids = tuple(np.frombuffer(base64.b64decode(meta["token_ids"]), dtype=ids_dtype).tolist())
    if len(token_ids) != shape[2]:
        raise CorruptEntry(f"{len(token_ids)} token ids for {shape[2]} tokens")
    return EncodedKV(
        tensors, codec, DTYPES[meta["dtype"]], shape, int(meta["start"]), token_ids, meta["fingerprint"], meta["mode"]
    )


def loads(data: bytes, key: str) -> EncodedKV:
    """Parse and verify bytes written by `dumps` for `key`; raises `CorruptEntry`."""
    try:
        n = int.from_bytes(data[:8], "little")
        if len(data) < 8 + n:
            raise CorruptEntry(f"truncated: {len(data)} bytes, header alone needs {8 + n}")
        meta = json.loads(data[8 : 8 + n]).get("__metadata__")
        return _check(key, meta, st_load(data))
    except CorruptEntry:
        raise
    except _LOAD_ERRORS as e:
        raise CorruptEntry(f"unreadable entry: {e}") from e


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8,
              "I16": torch.int16}


def _parse_mapped(buf: mmap.mmap) -> tuple[dict[str, str] | None, dict[str, torch.Tensor]]:
    """Tensors viewing one mapping of one open file: a consistent snapshot even if the path is
    replaced meanwhile (safetensors' own loader may reopen the path, mixing two versions)."""
    size = len(buf)
    if size < 8:
        raise CorruptEntry(f"truncated: {size} bytes")
    n = int.from_bytes(buf[:8], "little")
    if 8 + n > size:
        raise CorruptEntry(f"truncated: {size} bytes, header alone needs {8 + n}")
    header = json.loads(buf[8 : 8 + n])
    meta = header.pop("__metadata__", None)
    base, end = 8 + n, 8 + n
    tensors = {}
    for name, info in header.items():
        dtype = _ST_DTYPES[info["dtype"]]
        shape = [int(d) for d in info["shape"]]
        lo, hi = (int(x) for x in info["data_offsets"])
        numel = math.prod(shape)
        if not (0 <= lo <= hi and base + hi <= size and hi - lo == numel * dtype.itemsize):
            raise CorruptEntry(f"tensor {name} out of bounds ({lo}, {hi}) in a {size}-byte file")
        end = max(end, base + hi)
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        elif (base + lo) % dtype.itemsize:
            tensors[name] = torch.frombuffer(bytearray(buf[base + lo : base + hi]), dtype=dtype).view(shape)
        else:
            tensors[name] = torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + lo).view(shape)
    if end != size:
        raise CorruptEntry(f"{size}-byte file, tensors end at {end}")
    return meta, tensors


def load_file(path: str | os.PathLike[str], key: str) -> EncodedKV:
    """Memory-mapped load and check; FileNotFoundError if absent, `CorruptEntry` if not trustworthy.

    The tensors are views of a private mapping: a "native" entry's tensors must be copied before
    they outlive the call if the file could be truncated in place (ours never are; replace is atomic).
    """
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError as e:  # an empty file cannot be mapped
            raise CorruptEntry(f"unreadable entry: {e}") from e
    try:
        meta, tensors = _parse_mapped(buf)
        return _check(key, meta, tensors)
    except CorruptEntry:
        raise
    except (*_LOAD_ERRORS, AttributeError) as e:
        raise CorruptEntry(f"malformed entry: {e}") from e


def read_header(path: str | os.PathLike[str]) -> dict[str, str]:
    """The header alone (no checksum check): cheap, for rebuilding an index."""
    try:
        with safe_open(os.fspath(path), framework="pt") as f:
            meta = f.metadata()
    except _LOAD_ERRORS as e:
        raise CorruptEntry(f"unreadable header: {e}") from e
    if not meta or meta.get("format") != MAGIC:
        raise CorruptEntry(f"not a {MAGIC} entry")
    return meta
