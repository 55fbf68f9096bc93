"""Which device and dtype a model runs in: dtype names, the CPU's features, the default per device, the
torch threads of the calling thread. Split from `loading.py`, which re-exports these names."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
_CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# bf16 is the default on a CPU with bf16 units, measured on this project's avx512_bf16 machine on
# 2026-11-23 (docs/bench/dtype-2026-11-23/, README "bf16 against fp32"): the engine decodes 1.35x and
# answers a cached prompt 1.18-1.26x sooner than in fp32, and its answers keep full prefill's in bf16 as
# they do in fp32 (retained 0.97/1.00/1.03 at k=4/8/12, fp32 0.97/0.97/1.03). A CPU without them
# stays fp32, where bf16 is emulated and slow.
CPU_BF16_DEFAULT = True


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """"auto"/None → None (the device's default), else a float dtype: float32, bfloat16, float16
    (or fp32, bf16, fp16). A clear ValueError names the valid choices."""
    if name is None or isinstance(name, torch.dtype):
        return name
    key = _DTYPE_ALIASES.get(name.strip().lower().removeprefix("torch."), name.strip().lower().removeprefix("torch."))
    if key == "auto":
        return None
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; valid: auto, {', '.join(DTYPES)} (or fp32, bf16, fp16)")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 → "bfloat16": the spelling manifests and reports record."""
    return str(dtype).removeprefix("torch.")


def cpuinfo_flags() -> frozenset[str]:
    """Every flag /proc/cpuinfo lists for the CPU (empty where there is no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_flags() -> tuple[str, ...]:
    """The CPU features that matter for inference speed, as /proc/cpuinfo lists them (empty elsewhere)."""
    present = cpuinfo_flags()
    return tuple(f for f in _CPU_FLAGS if f in present)


def onednn_bf16() -> bool:
    """Whether torch's oneDNN kernels run bf16 on this CPU (False on a torch built without oneDNN)."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported is not None and torch.backends.mkldnn.is_available() and supported())


def cpu_has_bf16() -> bool:
    """bf16 units in the CPU (avx512_bf16, AMX) that torch's oneDNN kernels use."""
    return bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags())) and onednn_bf16()


def resolve_device_dtype(
    device: str | torch.device | None, dtype: str | torch.dtype | None
) -> tuple[torch.device, torch.dtype]:
    """None → cuda if available else cpu. dtype None/"auto" → bf16 on CUDA where supported (else
    fp16); on CPU bf16 where the CPU has bf16 units (`CPU_BF16_DEFAULT` says why), else fp32."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    chosen = parse_dtype(dtype)
    if chosen is None:
        if dev.type == "cpu":
            chosen = torch.bfloat16 if CPU_BF16_DEFAULT and cpu_has_bf16() else torch.float32
        elif dev.type == "cuda" and torch.cuda.is_bf16_supported():
            chosen = torch.bfloat16
        else:
            chosen = torch.float16
    return dev, chosen


@contextmanager
def torch_threads(num: int) -> Iterator[None]:
    """Run with `num` torch threads in this thread (0: as it is), its own count restored after: the count is
    per thread, and a new thread need not start with the one its creator set."""
    was = torch.get_num_threads()
    if num and num != was:
        torch.set_num_threads(num)
    try:
        yield
    finally:
        if num and num != was:
            torch.set_num_threads(was)
