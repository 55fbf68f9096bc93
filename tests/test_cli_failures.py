"""The CLI as a user runs it (a real process): failures leave nothing behind and say what to do.

A failed ingest leaves no half-made corpus; an unreachable hub fails at once with a clear line;
a damaged manifest.json, index.faiss or chunks.sqlite names the file and the fix, and exits 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import fakes, run  # noqa: F401 - fixtures

ROOT = Path(__file__).resolve().parents[1]


def cli(*argv: object, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rag_promptcache.cli", *map(str, argv)], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout)


def test_failed_ingest_leaves_nothing_and_an_unreachable_hub_fails_fast(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("The zorblat is purple.")
    # a closed local port stands in for "no network": the probe is refused at once, where
    # transformers' own download would have retried for ~25 s
    refused = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0"}
    done = cli("ingest", tmp_path / "d", "--corpus", tmp_path / "c", "--model", "nobody/no-such-model", env=refused, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "'nobody/no-such-model' is not in the hub cache and the hub (127.0.0.1:9) is unreachable" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "c").exists()
    offline = cli("ingest", tmp_path / "d", "--corpus", tmp_path / "c", "--model", "nobody/no-such-model",
                  env={"HF_HUB_OFFLINE": "1"}, timeout=60)
    assert offline.returncode == 1 and "could not load hub id 'nobody/no-such-model'" in offline.stderr, offline.stderr
    assert not (tmp_path / "c").exists()
    (tmp_path / "empty").mkdir()  # an empty directory the user made stays, empty
    cli("ingest", tmp_path / "d", "--corpus", tmp_path / "empty", "--model", "nobody/no-such-model", env=refused, timeout=60)
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())


@pytest.fixture
def corpus_dir(tmp_path: Path, fakes) -> Path:
    """A real corpus on disk (fake engine and embedder: these failures happen before any model runs)."""
    from test_rag_corpus import FakeEmbedder, FakeEngine, write_docs

    from rag_promptcache.rag import Corpus

    Corpus.build([write_docs(tmp_path / "docs")], tmp_path / "c", engine=FakeEngine(), embedder=FakeEmbedder(),
                 chunk_tokens=32, overlap=8, progress=False).close()
    return tmp_path / "c"


@pytest.mark.parametrize("name", ["manifest.json", "chunks.sqlite"])
def test_a_damaged_corpus_file_is_named_with_the_fix(corpus_dir: Path, name: str, capsys) -> None:
    (corpus_dir / name).write_bytes(b"\x00garbage, not what was written\xff" * 8)
    for argv in (["info", "--corpus", corpus_dir], ["ask", "--corpus", corpus_dir, "anything?"], ["remove", "x", "--corpus", corpus_dir]):
        code, _, err = run(capsys, *argv)
        assert code == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: {corpus_dir / name} is damaged (") and "re-ingest the documents into a new corpus" in last
        assert "Traceback" not in err


def test_a_damaged_index_is_rebuilt_from_the_table(corpus_dir: Path, capsys) -> None:
    import json

    (corpus_dir / "index.faiss").write_bytes(b"not a faiss index")
    code, out, err = run(capsys, "info", "--corpus", corpus_dir, "--json")
    assert code == 0, err
    assert f"warning: {corpus_dir / 'index.faiss'} or index.json is damaged" in err
    facts = json.loads(out)
    assert facts["num_vectors"] == facts["num_modules"] > 0
    code, out, err = run(capsys, "ask", "--corpus", corpus_dir, "volcano lava?", "-k", "1", "--json")
    assert code == 0 and json.loads(out)["sources"] == ["sub/volcano.txt"], err
