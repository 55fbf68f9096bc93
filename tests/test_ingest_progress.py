"""An ingest's progress (rag/progress.py): a bar with an ETA on a terminal, a line with an ETA every
interval elsewhere; and its estimate before it starts, of what is left when it resumes."""

from __future__ import annotations

import functools
import io
import itertools
import re
from pathlib import Path

import pytest
from test_cli import run, use_fake_models
from test_corpus_codec import SizedEngine
from test_rag_corpus import write_docs

from rag_promptcache.rag import ingest, progress
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag.corpus import Corpus


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_come_every_interval_with_the_time_left():
    clock, out = Clock(), io.StringIO()
    lines = progress.Lines(1000, interval=10.0, file=out, clock=clock)
    clock.now = 4.0
    lines.update(100, 2)  # before the interval: no line
    assert out.getvalue() == ""
    clock.now = 20.0
    lines.update(150, 3)  # 250 of 1000 in 20 s: 60 s left at that pace
    clock.now = 25.0
    lines.update(50, 1)  # within the interval of the last line: none
    assert out.getvalue().splitlines() == ["ingest: 250 of ~1,000 tokens (25%), 5 modules, 20s so far, about 1m00s left"]
    clock.now = 3700.0
    lines.update(700, 9)
    assert out.getvalue().splitlines()[-1].endswith("1:01:40 so far, finishing")


def test_the_interval_comes_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    monkeypatch.setenv(progress.INTERVAL_ENV, "2.5")
    assert progress.interval_s() == 2.5
    monkeypatch.setenv(progress.INTERVAL_ENV, "soon")
    with pytest.raises(ValueError, match="RAG_PROMPTCACHE_PROGRESS_S is 'soon'; valid: seconds"):
        progress.interval_s()
    monkeypatch.delenv(progress.INTERVAL_ENV)
    assert progress.interval_s() == progress.DEFAULT_INTERVAL_S


def test_the_bar_shows_an_eta_and_ends_full_when_the_estimate_ran_low():
    out = io.StringIO()
    bar = progress.Bar(100, file=out)
    bar.bar.start_t -= 10.0  # ten seconds in, whatever the clock's resolution (the coarse-clock tier)
    bar.update(40, 2)
    bar.bar.refresh()
    shown = out.getvalue().split("\r")[-1]
    assert re.search(r"40(\.0)?/100 \[\d\d:\d\d<\d\d:\d\d", shown) and "2 modules" in shown, shown  # elapsed<left
    bar.update(90, 3)
    assert bar.bar.total == bar.bar.n == 130
    bar.close()


def test_an_ingest_not_on_a_terminal_prints_lines_with_an_eta(tmp_path: Path, monkeypatch, capsys):
    use_fake_models(monkeypatch, SizedEngine())
    monkeypatch.setattr(corpus_mod, "BATCH_CHUNKS", 2)  # a few batches of the small test documents
    monkeypatch.setenv(progress.INTERVAL_ENV, "0.5")  # a line for every batch: a second passes between them
    seconds = itertools.count(0.0, 1.0)
    monkeypatch.setattr(progress, "Lines", functools.partial(progress.Lines, clock=lambda: next(seconds)))
    code, _, err = run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", tmp_path / "c", "--chunk-tokens", "32")
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("ingest: ")]
    assert len(lines) >= 2, err
    assert all(re.fullmatch(r"ingest: [\d,]+ of ~[\d,]+ tokens \(\d+%\), [\d,]+ modules, \d+s so far, "
                            r"(about \S+ left|finishing)", line) for line in lines), lines
    assert "left" in lines[0]


def test_a_resumed_ingest_estimates_what_is_left(tmp_path: Path, monkeypatch):
    use_fake_models(monkeypatch, SizedEngine())
    monkeypatch.setattr(corpus_mod, "BATCH_CHUNKS", 2)  # a few batches of the small test documents
    monkeypatch.setattr(ingest, "LARGE_INGEST_TOKENS", 1)
    docs = write_docs(tmp_path / "docs")
    first: list = []

    def stop_after_one_batch(num_modules: int, num_tokens: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Corpus.build([docs], tmp_path / "c", chunk_tokens=32, on_estimate=first.append, on_batch=stop_after_one_batch,
                     progress=False)
    c = Corpus.open(tmp_path / "c")
    done = sum(n for _, _, n in c.table.module_keys())
    assert 0 < done < first[0].num_tokens
    again: list = []
    c.add([docs], on_estimate=again.append, progress=False)
    assert again[0].num_tokens == first[0].num_tokens - done
    c.close()
