"""Native CPU kernels (`kernels/*.c`): built when the package is installed, loaded with ctypes.

Four hot spots have kernels here, for x86 CPUs with AVX512-BF16 and bf16 tensors: the question's
attention against the assembled cache (`prefill_attention.c`, used by engine/compute/attention.py), the
relocation of a module's keys into that cache (`rope_shift.c`, used by
positions.RopeRelocator.rotate_into), the decode step of a Llama model, every layer in one call
(`decode_step.c`, used by engine/compute/native_step.py), and the decoding of a quantized store entry
(`dequantize.c`, used by store/codecs.py). Each computes what the torch code it replaces
computes, with the same fp32 arithmetic and bf16 roundings (tests/test_native.py,
tests/test_attention.py, tests/test_native_step.py).

Building. The sources are plain C with no torch headers, so a build takes about a second: `$CC`
(else `cc` or `gcc`). It happens at install time (setup.py's build step calls `build`, for a wheel and
for `pip install -e .`), or by hand: `rag-promptcache kernels build`, which writes into
the package when it can and else into `<cache home>/kernels/` (a read-only install). A build writes
under a temporary name and renames, so a concurrent process never loads a half-written file. The
library uses OpenMP from libgomp.so.1, the runtime torch's CPU wheels have already loaded: its loops run
on torch's own worker threads rather than a second pool that would fight them for the cores.

Loading. `library()` never compiles. It loads a library only if this installation built it: next to the
library, the build writes a record (`<library>.json`) with its sha256 and a digest of the sources and
flags it was built from; the library loads only when its bytes hash to the record, the record names
these sources, and the library, its record and their directory belong to this user or root and are not
writable by group or others (so nobody else can swap the file between the check and the load).

`library()` is None, and callers run the torch code, wherever the kernels cannot run: a CPU without
avx512_bf16, no library that passes the checks (warned once, with the command that builds one), or
`RAG_PROMPTCACHE_KERNELS=0`.

This file imports only the standard library at module level, so setup.py can load it by path before
torch is installed. Out of scope: CUDA (the torch code runs there), other CPU instruction sets, fp32
and fp16.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path

KERNELS_ENV = "RAG_PROMPTCACHE_KERNELS"  # "0": the torch code everywhere
KERNELS_DIR = Path(__file__).with_name("kernels")  # the sources, and the library an install builds
SOURCES = tuple(sorted(KERNELS_DIR.glob("*.c")))
HEADERS = tuple(sorted(KERNELS_DIR.glob("*.h")))  # included by the sources (simd.h): part of what a build is from
LIBRARY_NAME = "librag-promptcache-kernels.so"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-ffp-contract=off",
         "-fopenmp", "-shared", "-fPIC")
_NEEDS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})  # /proc/cpuinfo's names for FLAGS
_RECORD_VERSION = 1  # bumped when the record's fields change
BUILD_HINT = "rag-promptcache kernels build"

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}  # "lib": the library, or None once known not to run here


def enabled() -> bool:
    return os.environ.get(KERNELS_ENV, "1").strip().lower() not in ("0", "false", "off")


def cpu_supports() -> bool:
    # imported here, not at the top: loading imports torch, and setup.py loads this file without it
    from rag_promptcache.model.loading import cpuinfo_flags

    return _NEEDS <= cpuinfo_flags()


def sources_digest() -> str:
    """What a library is built from: the sources, the headers they include and the flags, hashed."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(FLAGS).encode()).hexdigest()


def user_dir() -> Path:
    """Where `rag-promptcache kernels build` writes when the package is read-only."""
    from rag_promptcache.model.loading import cache_home

    return cache_home() / "kernels"


def candidates() -> tuple[Path, ...]:
    """The places a library may be, in the order `library()` tries them: the package, then the user's."""
    return (KERNELS_DIR / LIBRARY_NAME, user_dir() / LIBRARY_NAME)


def library_path() -> Path | None:
    """The library `library()` loads (or would): the first candidate that passes the checks, else None."""
    return next((p for p in candidates() if check(p) is None), None)


def record_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def build(path: Path) -> str | None:
    """Compile the kernels to `path` and write its record beside it; None on success, else why not."""
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not compiler[0]:
        return "no C compiler found (set CC, or install gcc)"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create {path.parent}: {e}"
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        proc = subprocess.run([*compiler, *FLAGS, "-o", str(tmp), *map(str, SOURCES)],
                              capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        tmp.unlink(missing_ok=True)
        return f"{' '.join(compiler)} failed to run: {e}"
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"{' '.join(compiler)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"
    record = {"version": _RECORD_VERSION, "sha256": hashlib.sha256(tmp.read_bytes()).hexdigest(),
              "sources": sources_digest(), "compiler": " ".join(compiler), "flags": list(FLAGS)}
    record_tmp = record_path(tmp)
    try:
        os.chmod(tmp, 0o755)  # whatever the umask: a group- or world-writable library is refused on load
        record_tmp.write_text(json.dumps(record, indent=1))
        os.chmod(record_tmp, 0o644)
        # the library first: a reader between the two renames sees an old record that does not match it
        os.replace(tmp, path)
        os.replace(record_tmp, record_path(path))
    except OSError as e:
        tmp.unlink(missing_ok=True)
        record_tmp.unlink(missing_ok=True)
        return f"cannot write {path}: {e}"
    return None


def check(path: Path) -> str | None:
    """None where `path` is a library this installation built and may load, else why not."""
    try:
        for p in (path.parent, path, record_path(path)):
            st = p.stat()
            if st.st_uid not in (os.geteuid(), 0):
                return f"{p} belongs to uid {st.st_uid}, not to this user or root"
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return f"{p} is writable by group or others (mode {stat.filemode(st.st_mode)})"
        record = json.loads(record_path(path).read_text())
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError as e:
        # a library without its record was not built by `build` (or its build did not finish)
        return f"{path} is not built" if e.filename != str(record_path(path)) else f"{path} has no build record"
    except (OSError, ValueError) as e:
        return f"cannot read {path} or its record: {e}"
    if not isinstance(record, dict) or record.get("version") != _RECORD_VERSION:
        return f"{record_path(path)} is not a version-{_RECORD_VERSION} build record"
    if record.get("sha256") != digest:
        return f"{path} is not the file its build recorded (sha256 differs)"
    if record.get("sources") != sources_digest():
        return f"{path} was built from other sources or flags (rebuild it)"
    return None


def library() -> ctypes.CDLL | None:
    """The loaded kernels; None where they cannot run here. Cheap after the first call; never compiles."""
    if not enabled():
        return None
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _load()
        return _loaded["lib"]


def _load() -> ctypes.CDLL | None:
    if not cpu_supports():
        return None
    why = []
    try:
        paths = candidates()
    except (OSError, RuntimeError) as e:  # no home directory to put a cache home in: the package's only
        paths, why = (KERNELS_DIR / LIBRARY_NAME,), [f"no user directory: {e}"]
    for path in paths:
        reason = check(path)
        if reason is None:
            try:
                return _declare(ctypes.CDLL(str(path)))
            except OSError as e:
                reason = f"{path} does not load: {e}"
        why.append(reason)
    warnings.warn(f"rag-promptcache: no native CPU kernels were built for this installation, so the torch code "
                  f"runs instead (slower, same results); build them with `{BUILD_HINT}`. {'; '.join(why)}",
                  RuntimeWarning, stacklevel=3)
    return None


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.prefill_attention.argtypes = [ptr] * 5 + [i64] * 7 + [ctypes.c_float, ctypes.c_int]
    lib.rope_shift_bf16.argtypes = [ptr] * 2 + [i64] * 9 + [ptr] * 2 + [ctypes.c_int]
    lib.llama_decode_bf16.argtypes = [ptr] * 5 + [i64] * 9 + [ctypes.c_float, ptr, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.llama_decode_batch_bf16.argtypes = ([ptr] * 5 + [i64, ptr] + [i64] * 7
                                            + [ctypes.c_float, ptr, i64, ptr, ptr, ptr, ctypes.c_int])
    lib.dequantize_bf16.argtypes = [ptr] + [i64] * 4 + [ctypes.c_int] + [ptr] * 2 + [ctypes.c_int, ptr, ctypes.c_int]
    for fn in (lib.prefill_attention, lib.rope_shift_bf16, lib.llama_decode_bf16, lib.llama_decode_batch_bf16,
               lib.dequantize_bf16):
        fn.restype = ctypes.c_int
    return lib


def main(argv: list[str] | None = None) -> int:
    """`build [DIR]`: build into DIR, else the package where writable, else the user's directory.
    `check`: say which library loads here, or why none does."""
    import argparse

    parser = argparse.ArgumentParser(prog="rag-promptcache kernels", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="compile the kernels").add_argument("dir", nargs="?", type=Path)
    sub.add_parser("check", help="say which library loads here")
    args = parser.parse_args(argv)
    if args.command == "build":
        target = args.dir or (KERNELS_DIR if os.access(KERNELS_DIR, os.W_OK) else user_dir())
        why = build(target / LIBRARY_NAME)
        print(why or f"built {target / LIBRARY_NAME}", file=sys.stderr if why else sys.stdout)
        return 1 if why else 0
    for line in check_lines(candidates()):
        print(line)
    if not cpu_supports():
        print("this CPU lacks avx512_bf16: the torch code runs")
        return 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # its warning says what the lines above say
        return 0 if library() is not None else 1


def check_lines(paths: tuple[Path, ...]) -> list[str]:
    """`kernels check`'s report: each place a library may be, in the order `library()` tries them, and
    which copy is used; a place after the used one is optional, and said to be, so that its "not
    built" does not read like a failure."""
    used = None
    lines = []
    for path in paths:
        why = check(path)
        said = f"{path}: ok" if why is None else why if why.startswith(str(path)) else f"{path}: {why}"
        if used is not None:
            lines.append(f"{said} (optional, not needed: the copy above is used)")
        elif why is None:
            used = path
            lines.append(f"{said}, this copy is used")
        else:
            lines.append(said)
    if used is None:
        lines.append(f"no copy can be used: the torch code runs instead (slower, same results); build one with "
                     f"`{BUILD_HINT}`")
    return lines


if __name__ == "__main__":
    sys.exit(main())
