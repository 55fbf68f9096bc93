"""Directories of model weights kept under the cache home: a converted GGUF (model/loading.py) and a base
model with its tuned adapter merged in. Each is written into a temporary directory and renamed into
place, with a source file naming what it was made from, so a reader sees either no cache or a whole
one, and two processes writing at once both end with a whole one.

Not here: what goes into a directory (the caller's `write`), nor where the cache home is (loading.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE_FILE = "rag_promptcache_source.json"  # marks a finished directory and what it came from
CACHE_VERSION = 1  # bumped when the layout of a cached directory changes
# Where a weight file's tensors start, in bytes: a multiple of a cache line and of an AVX-512 vector.
# The file is mapped at a page boundary, so a tensor at an aligned offset is used in place (`aligned`).
ALIGN = 64


def source_key(directory: Path) -> str | None:
    """The source a finished cached directory was made from; None when it is not one (or of another layout)."""
    try:
        meta = json.loads((directory / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("source_key") if meta.get("cache_version") == CACHE_VERSION else None


def matches(directory: Path, key: str) -> bool:
    return source_key(directory) == key


def build(target: Path, key: str, write: Callable[[Path], None], **meta: str) -> Path:
    """`target`, made by `write(directory)` unless a finished one from `key` is there already."""
    if matches(target, key):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        write(tmp)
        (tmp / SOURCE_FILE).write_text(json.dumps({"source_key": key, **meta, "cache_version": CACHE_VERSION}, indent=1))
        install(tmp, target, key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already if the rename succeeded
    assert matches(target, key), f"{target=} {key=}"
    return target


def install(tmp: Path, target: Path, key: str) -> None:
    """Rename a finished directory into place; a concurrent winner with the same source is kept."""
    try:
        os.rename(tmp, target)
        return
    except OSError:
        if matches(target, key):
            return  # another process finished first
    # A stale cache (other source or layout) is in the way: move it aside, then retry once.
    stale = Path(tempfile.mkdtemp(prefix=f".stale-{target.name}-", dir=target.parent))
    try:
        os.rename(target, stale / "old")
    except OSError:
        pass  # someone else moved it already
    try:
        os.rename(tmp, target)
    except OSError:
        if not matches(target, key):
            raise
    finally:
        shutil.rmtree(stale, ignore_errors=True)


def save_weights(model: torch.nn.Module, out: Path) -> None:
    """`model`'s state dict as `out/model.safetensors`, which `from_pretrained` reads back.

    Tied weights share storage and safetensors refuses shared tensors; from_pretrained re-ties
    them from the config, so only the source of each tie is written."""
    state = model.state_dict()
    tied = getattr(model, "_tied_weights_keys", None) or {}
    tied_targets = set(tied)
    groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        groups.setdefault(key, []).append(name)
    for names in groups.values():
        keep = next((n for n in names if n not in tied_targets), names[0])
        for name in names:
            if name != keep:
                assert name in tied_targets, f"shared tensor that from_pretrained would not re-tie: {name=} {keep=}"
                del state[name]
    write_aligned({k: v.detach().to("cpu").contiguous() for k, v in state.items()}, out / "model.safetensors")


def write_aligned(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """`tensors` as a safetensors file whose data starts at a multiple of `ALIGN` bytes: its header padded
    with spaces, as the format allows. safetensors pads it to 8 only, and mapped at that offset the weights
    sat 8 bytes off every cache line. A tensor whose size is a multiple of `ALIGN` (every weight of the
    default model) then starts aligned too."""
    from safetensors.torch import save

    blob = memoryview(save(tensors, metadata={"format": "pt"}))
    num_header = int.from_bytes(blob[:8], "little")
    pad = -(8 + num_header) % ALIGN
    with open(path, "wb") as f:
        f.write((num_header + pad).to_bytes(8, "little"))
        f.write(blob[8:8 + num_header])
        f.write(b" " * pad)
        f.write(blob[8 + num_header:])


def aligned(tensor: torch.Tensor) -> bool:
    """Whether `tensor` starts at a multiple of `ALIGN` bytes in memory."""
    return tensor.data_ptr() % ALIGN == 0
