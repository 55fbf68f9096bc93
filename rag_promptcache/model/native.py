"""Native CPU kernels (`kernels/*.c`): built on first use with the system C compiler, loaded with ctypes.

Two hot spots of a cached prompt have kernels here, for x86 CPUs with AVX512-BF16 and bf16 tensors:
the question's attention against the assembled cache (`prefill_attention.c`, used by
engine/attention.py) and the relocation of a module's keys into that cache (`rope_shift.c`, used by
positions.RopeRelocator.rotate_into). Each computes what the torch code it replaces computes, with
the same fp32 arithmetic and bf16 roundings (tests/test_native.py, tests/test_attention.py).

The sources are plain C with no torch headers, so the build takes about a second: `$CC` (else `cc`
or `gcc`), into `<cache home>/kernels/`, named by a hash of the sources and flags, written under a
temporary name and renamed, so concurrent processes never load a half-written file. The library
uses OpenMP from libgomp.so.1, the runtime torch's CPU wheels have already loaded: its loops run on
torch's own worker threads rather than a second pool that would fight them for the cores.

`library()` is None, and callers run the torch code, wherever the kernels cannot run: a CPU without
avx512_bf16, no compiler or a failed build (warned once), or `RAG_PROMPTCACHE_KERNELS=0`.

Out of scope: CUDA (the torch code runs there), other CPU instruction sets, fp32 and fp16.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import threading
import warnings
from pathlib import Path

from rag_promptcache.model.loading import cache_home, cpuinfo_flags

KERNELS_ENV = "RAG_PROMPTCACHE_KERNELS"  # "0": the torch code everywhere
SOURCES = tuple(sorted((Path(__file__).with_name("kernels")).glob("*.c")))
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-ffp-contract=off",
         "-fopenmp", "-shared", "-fPIC")
_NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})  # /proc/cpuinfo's names for FLAGS

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # "lib": the library, or None once known not to run here


def enabled() -> bool:
    return os.environ.get(KERNELS_ENV, "1").strip().lower() not in ("0", "false", "off")


def cpu_supports() -> bool:
    return _NEEDS <= cpuinfo_flags()


def library_path() -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + " ".join(FLAGS).encode()).hexdigest()
    return cache_home() / "kernels" / f"rag-promptcache-{digest[:16]}.so"


def build(path: Path) -> str | None:
    """Compile the kernels to `path`; None on success, else why not."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        return "no C compiler found (set CC, or install gcc)"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run([*compiler, *FLAGS, "-o", str(tmp), *map(str, SOURCES)],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(compiler)} failed to run: {e}"
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"{' '.join(compiler)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
    os.replace(tmp, path)
    return None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, built first if needed; None where they cannot run here."""
    if not enabled():
        return None
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


def _load() -> ctypes.CDLL | None:
    if not cpu_supports():
        return None
    path = library_path()
    why = None if path.exists() else build(path)
    if why is None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # a damaged or foreign file under the right name: build it again, once
            why = build(path)
            lib = ctypes.CDLL(str(path)) if why is None else None
    if why is not None:
        warnings.warn(f"rag-promptcache: the native CPU kernels could not be built, so the torch code runs "
                      f"instead (slower, same results): {why}", RuntimeWarning, stacklevel=3)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.prefill_attention.argtypes = [ptr] * 5 + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
    lib.rope_shift_bf16.argtypes = [ptr] * 2 + [i64] * 9 + [ptr] * 2 + [ctypes.c_int]
    for fn in (lib.prefill_attention, lib.rope_shift_bf16):
        fn.restype = ctypes.c_int
    return lib
