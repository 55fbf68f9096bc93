"""`info` reads and writes nothing: on a corpus whose ingest was interrupted before it saved its indexes,
it says the ingest was interrupted and that running it again resumes; `ingest` is what repairs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_cli import run, use_fake_models
from test_rag_corpus import FakeEngine, write_docs

from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag.corpus import Corpus


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and mtime, but SQLite's shared-memory index (`-shm`), which every reader of a
    database in WAL mode maps and marks: it holds no data, and the database and its log are compared."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.endswith("-shm")}


@pytest.mark.parametrize("kv", ["eager", "lazy"])
def test_info_on_an_interrupted_corpus_writes_nothing_and_says_interrupted(tmp_path: Path, monkeypatch, capsys, kv):
    use_fake_models(monkeypatch, FakeEngine())
    monkeypatch.setattr(corpus_mod, "BATCH_CHUNKS", 2)
    docs = write_docs(tmp_path / "docs")

    def stop(num_modules: int, num_tokens: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Corpus.build([docs], tmp_path / "c", chunk_tokens=32, kv=kv, on_batch=stop, progress=False)
    # A process killed mid-ingest (SIGKILL, a power cut) leaves what this copy holds: the table's write-ahead
    # log not checkpointed (the interrupted corpus's connection is still open here), and no saved indexes
    # (an interrupt saves them on its way out; a kill does not).
    shutil.copytree(tmp_path / "c", tmp_path / "killed")
    (tmp_path / "killed" / "index.faiss").unlink()
    shutil.rmtree(tmp_path / "killed" / "lexical")
    assert (tmp_path / "killed" / "chunks.sqlite-wal").stat().st_size > 0
    before = snapshot(tmp_path / "killed")
    code, out, err = run(capsys, "info", "--corpus", tmp_path / "killed")
    assert code == 0, err
    assert snapshot(tmp_path / "killed") == before  # byte for byte, and not one file touched
    assert "interrupted" in err and "run ingest again to resume" in err and "wrote nothing" in err, err
    assert "; rebuilt" not in err and "and saved" not in err
    assert "incomplete: the last ingest was interrupted; run ingest again to resume" in out
    code, _, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "killed")  # the repair is ingest's
    assert code == 0, err
    assert (tmp_path / "killed" / "index.faiss").is_file() and (tmp_path / "killed" / "lexical").is_dir()
    before = snapshot(tmp_path / "killed")
    code, out, err = run(capsys, "info", "--corpus", tmp_path / "killed")
    assert code == 0 and "warning" not in err and "incomplete" not in out and snapshot(tmp_path / "killed") == before
