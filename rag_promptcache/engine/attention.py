"""Fused attention for a prefill against a cache on CPUs with AVX512-BF16 (`kernels/prefill_attention.c`).

What is left of a cached prompt's time to first token is the forward over the question's tokens
against the assembled cache, and half of it was attention. For 41 new tokens against 2k cached ones
SDPA's CPU flash kernel ran at about 116 GFLOP/s on this project's 2-core machine, a third of what
the same CPU's bf16 matmul reaches. Plain bf16 matmuls would be faster but round every score to bf16
(0.08 off at a score of 20). This kernel keeps SDPA's arithmetic instead: scores accumulated in fp32
by the CPU's bf16 dot-product instruction and never rounded, an online fp32 softmax, probabilities
rounded to bf16 for the product with V. Its error against an fp64 reference matches SDPA's
(tests/test_attention.py).

It is C with no torch headers, built on first use with the system C compiler (`$CC`, else `cc` or
`gcc`, about a second) into `<cache home>/kernels/`, keyed by a hash of its source and flags, and
loaded with ctypes. `prefill_attention` returns None wherever the kernel does not apply and the
caller runs SDPA: another device or dtype, a CPU without avx512_bf16, no compiler, a failed build
(warned once), or `RAG_PROMPTCACHE_ATTN_KERNEL=0`.

Out of scope: masks other than "every cached key, then causal among the new tokens" (parameters
inside modules, recovered tokens before cached ones: SDPA with the mask), fp32 and fp16, CUDA, and
batches of more than one sequence.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

import torch

from rag_promptcache.model.loading import cache_home

KERNEL_ENV = "RAG_PROMPTCACHE_ATTN_KERNEL"  # "0": always SDPA
SOURCE = Path(__file__).with_name("kernels") / "prefill_attention.c"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp", "-shared", "-fPIC")
_NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})  # /proc/cpuinfo's names for FLAGS
MAX_DIM = 256  # the kernel's limit on head_dim (MAX_DIM in the C source)

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "fn": the ctypes function, or None once it is known not to run here


def enabled() -> bool:
    return os.environ.get(KERNEL_ENV, "1").strip().lower() not in ("0", "false", "off")


def _cpu_supports() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return _NEEDS <= set(line.partition(":")[2].split())


def library_path() -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    return cache_home() / "kernels" / f"prefill_attention-{digest}.so"


def build(path: Path) -> str | None:
    """Compile the kernel to `path` (atomically: concurrent builders each rename their own file);
    None on success, else why not."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler found (set CC, or install gcc)"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", str(tmp), str(SOURCE)],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{compiler} failed to run: {e}"
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"{compiler} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
    os.replace(tmp, path)
    return None


def kernel() -> ctypes._CFuncPtr | None:
    """The loaded kernel, building it first if needed; None where it cannot run here."""
    if not enabled():
        return None
    with _lock:
        if "fn" not in _loaded:
            _loaded["fn"] = _load()
        return _loaded["fn"]


def _load() -> ctypes._CFuncPtr | None:
    if not _cpu_supports():
        return None
    path = library_path()
    if not path.exists():
        why = build(path)
        if why is not None:
            warnings.warn(f"rag-promptcache: the prefill attention kernel could not be built, so SDPA runs "
                          f"instead (slower, same results): {why}", RuntimeWarning, stacklevel=3)
            return None
    fn = ctypes.CDLL(str(path)).prefill_attention
    i64 = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p] * 4 + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_new: int,
                      scale: float) -> torch.Tensor | None:
    """softmax(q keysᵀ · scale + mask) values, where every query row sees all keys but the last
    `num_new` and, of those, the new tokens up to its own (row r is new token r % num_new).

    q: [1, Hkv, R, D] (query heads folded into rows); keys, values: [1, Hkv, C, D] with contiguous
    rows (the reserved cache's views) → [1, Hkv, R, D], or None where the kernel does not apply."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or q.shape[0] != 1 or q.shape[-1] > MAX_DIM:
        return None
    if keys.dtype != q.dtype or values.dtype != q.dtype or keys.stride(-1) != 1 or values.stride(-1) != 1:
        return None
    if keys.stride(-2) != q.shape[-1] or values.stride(-2) != q.shape[-1] or q.shape[-1] % 2:
        return None
    fn = kernel()
    if fn is None:
        return None
    q = q.contiguous()
    out = torch.empty_like(q)
    _, heads, rows, dim = q.shape
    rc = fn(q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), heads, rows, dim,
            keys.shape[-2], num_new, keys.stride(1), values.stride(1), scale, torch.get_num_threads())
    assert rc == 0, f"{rc=} {q.shape=} {keys.shape=} {num_new=}"
    return out
