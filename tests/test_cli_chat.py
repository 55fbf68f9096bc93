"""`chat` in a real terminal (a pty) with the real SmolLM2: Ctrl-C (SIGINT) mid-answer stops that
answer and the chat goes on with its history; Ctrl-C at the prompt says how to quit."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rag_promptcache.rag import Corpus
from rag_promptcache.rag import corpus as corpus_mod

pytestmark = pytest.mark.smollm
ROOT = Path(__file__).resolve().parents[1]


class Terminal:
    def __init__(self, argv: list[str]) -> None:
        self.master, slave = pty.openpty()
        # A user's shell starts the chat with Ctrl-C at its default; a test process may ignore SIGINT
        # (something earlier in the suite did), and an ignored signal stays ignored across exec.
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, close_fds=True,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), "TERM": "dumb"},
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        os.close(slave)
        self.seen = ""
        self.matched = 0  # where the last expected text ended: each expect looks only past it

    def expect(self, text: str, timeout: float = 180) -> str:
        end = time.monotonic() + timeout
        while text not in self.seen[self.matched:]:
            left = end - time.monotonic()
            assert left > 0 and self.proc.poll() is None, f"waiting for {text!r}; got:\n{self.seen}"
            if select.select([self.master], [], [], min(left, 1.0))[0]:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    pass
        self.matched = self.seen.index(text, self.matched) + len(text)
        return self.seen

    def read_past(self, num_chars: int, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while len(self.seen) < num_chars:
            assert time.monotonic() < end and self.proc.poll() is None, self.seen
            if select.select([self.master], [], [], 0.5)[0]:
                self.seen += os.read(self.master, 4096).decode(errors="replace")

    def send(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())


def test_ctrl_c_stops_an_answer_and_keeps_the_chat(smollm, tmp_path: Path, monkeypatch) -> None:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag import Embedder

    monkeypatch.setattr(corpus_mod, "_load_engine", lambda model, store, mode, dtype=None, adapter=None: PromptCache(*smollm, store=store, name=model))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "cats.txt").write_text("Cats sleep for most of the day. A cat purrs when it is content.")
    Corpus.build([tmp_path / "d"], tmp_path / "c", embedder=Embedder(), progress=False).close()

    term = Terminal([sys.executable, "-m", "rag_promptcache.cli", "chat", "--corpus", str(tmp_path / "c"),
                     "--max-new-tokens", "400", "--temperature", "0"])  # greedy: the same long answer every run
    try:
        term.expect("you> ")
        term.send("Write a very long story about cats, with many chapters.")
        before = len(term.expect("bot> "))
        term.read_past(before + 10)  # some of the answer is out: interrupt it mid-way
        term.proc.send_signal(signal.SIGINT)
        term.expect("[stopped; the chat goes on]")
        term.expect("you> ")
        term.proc.send_signal(signal.SIGINT)  # at the prompt
        term.expect("to quit, type /quit or press Ctrl-D")
        term.send("/sources")
        term.expect("cats.txt")  # the stopped answer's sources (it is not in the history, but it was drawn from these)
        term.send("/quit")
        assert term.proc.wait(timeout=60) == 0, term.seen
        assert "interrupted" not in term.seen and "Traceback" not in term.seen
        assert "Loading" not in term.seen.split("you> ", 1)[1]  # model loading output comes before the chat, not in it
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.master)
