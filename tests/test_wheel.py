"""What a user installs: an sdist built from this tree carries the kernels' sources and no built
library; the wheel built from that sdist carries the sources and the library with its build record;
installed into a fresh venv, the kernels load there (model/native.py, setup.py).

The fresh venv borrows torch and the other dependencies from the running interpreter's site-packages
through a .pth line (no network here), but gets rag_promptcache only from the wheel: a .pth line adds
a path without running that directory's own .pth files, so the editable install there stays off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

from rag_promptcache.model import native

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
KERNELS = "rag_promptcache/model/kernels/"
CHECK = """
import json, os, sys
import rag_promptcache
from rag_promptcache.model import native
lib = native.library()
print(json.dumps({"package": rag_promptcache.__file__, "path": str(native.library_path()), "loaded": lib is not None,
                  "cpu": native.cpu_supports()}))
"""


def _run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # the PEP 517 hooks pip calls, without build isolation: the build needs only setuptools, here already
    _run(sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})", cwd=ROOT)
    (sdist,) = out.glob("*.tar.gz")
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(sdist),
         cwd=out)
    return out


def test_the_sdist_carries_the_sources_and_no_library(dist):
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert {"setup.py", KERNELS + "prefill_attention.c", KERNELS + "rope_shift.c", KERNELS + "decode_step.c",
            KERNELS + "simd.h"} <= set(names)
    assert not [n for n in names if n.endswith((".so", ".so.json"))], names
    assert not [n for n in names if n.startswith("research/")], names  # the probes stay in the repository


def test_the_wheel_carries_the_sources_and_the_library(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # the research probes (research/) are run from the repository; the wheel carries the product only
    assert not [n for n in names if n.startswith("research/") or n.endswith(("_probe.py", "tune_run.py", "link_ttft.py"))]
    assert {KERNELS + "prefill_attention.c", KERNELS + "rope_shift.c", KERNELS + "decode_step.c", KERNELS + "simd.h"} <= names
    if native.build(tmp_path / "probe.so") is None:
        # where the compiler knows AVX512-BF16 the wheel has the library, whatever the CPU: it is checked on load
        assert {KERNELS + native.LIBRARY_NAME, KERNELS + native.LIBRARY_NAME + ".json"} <= names


def test_the_installed_wheel_loads_its_kernels_in_a_fresh_venv(dist, tmp_path):
    (wheel,) = dist.glob("*.whl")
    # no PYTHONPATH: a tree on it (with its egg-info) would look installed to pip and be imported instead
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", native.KERNELS_ENV)}
    env["RAG_PROMPTCACHE_HOME"] = str(tmp_path / "home")  # no library built by hand elsewhere can stand in
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp_path)
    python = venv / "bin" / "python"
    purelib = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path,
                        env=env).strip())
    # install first: with the borrowed path already there, pip would see this tree's editable install
    # as "already satisfied" and install nothing
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel), cwd=tmp_path, env=env)
    (purelib / "_borrowed_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    got = json.loads(_run(str(python), "-c", CHECK, cwd=tmp_path, env=env).strip().splitlines()[-1])
    assert Path(got["package"]).is_relative_to(venv), got  # the wheel's copy, not this tree's
    if not got["cpu"]:
        pytest.skip("no avx512_bf16 CPU here: the wheel's kernels cannot run")
    assert got["loaded"] and Path(got["path"]).is_relative_to(venv / "lib"), got
    off = json.loads(_run(str(python), "-c", CHECK, cwd=tmp_path, env={**env, native.KERNELS_ENV: "0"}).splitlines()[-1])
    assert not off["loaded"]
