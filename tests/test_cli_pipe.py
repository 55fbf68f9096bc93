"""Every command's output can be piped into `head` (issue 25, item 7): when the reader leaves, the
command ends quietly with 141, what a shell reports for a program SIGPIPE ended (`cat big | head`).

A real process writes into a real pipe whose reading end is already closed, so the first write
fails, as the write after `head -2`'s second line does, without a race on pipe buffer sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_cli import fakes  # noqa: F401 - fixture
from test_cli_failures import corpus_dir  # noqa: F401 - fixture

ROOT = Path(__file__).resolve().parents[1]


def into_closed_pipe(*argv: object) -> subprocess.CompletedProcess:
    read_end, write_end = os.pipe()
    os.close(read_end)  # nobody will read: `head` has already gone
    try:
        return subprocess.run([sys.executable, "-m", "rag_promptcache.cli", *map(str, argv)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        os.close(write_end)


def test_info_into_a_closed_pipe_ends_quietly_with_141(corpus_dir: Path) -> None:
    for argv in (["info", "--corpus", corpus_dir], ["info", "--corpus", corpus_dir, "--json"]):
        done = into_closed_pipe(*argv)
        assert done.returncode == 141, done.stderr
        assert done.stderr == "", done.stderr  # no "internal error: BrokenPipeError", no "Exception ignored"


def test_a_pipe_head_reads_what_it_wants(corpus_dir: Path) -> None:
    shell = f"{sys.executable} -m rag_promptcache.cli info --corpus {corpus_dir} | head -2; exit ${{PIPESTATUS[0]}}"
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stdout.splitlines()[0].startswith("corpus "), done.stdout
    assert len(done.stdout.splitlines()) == 2 and done.returncode in (0, 141), (done.returncode, done.stderr)
    assert "error" not in done.stderr, done.stderr
