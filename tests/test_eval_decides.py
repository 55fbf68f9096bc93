"""`eval` decides: it recommends a setting by the rule the engine default was chosen by (the fastest
that keeps >= 95% of full prefill's right answers, `fidelity.fastest_retaining`), shows the questions
that fail with the cached and the full answer side by side, judges the whole answer up to
--max-new-tokens (64 by default), and `--apply` makes the choice the corpus's recovery, which `ask`,
the engine the corpus loads (the server and the adapters call it) and `info` then show.

Over a fake engine whose answers and TTFT depend on the recovery: fast, and the expected pick is known."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_cli import run
from test_rag_corpus import FakeEmbedder, FakeEngine, write_docs

from rag_promptcache.cli.eval_cmd import SHOWN_NEW_TOKENS
from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
from rag_promptcache.engine.result import Result
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.rag.fidelity import DEFAULT_NEW_TOKENS, fastest_retaining
from rag_promptcache.rag.records import Manifest

PADDING = " ".join(["Looking at the documents"] * 8)  # 32 words before the fact: past the old 20-token cut
QUESTIONS = [("Which way does the Nile flow?", "north"), ("What do cats do when content?", "purr"),
             ("What cools into rock?", "lava")]
# (answer to the Nile question, TTFT) per setting; every other question is answered right everywhere
BEHAVIOUR = {"full": ("north", 0.5), "none": ("south", 0.01), "last:1": ("north", 0.05), DEFAULT_RECOVERY: ("north", 0.1)}


class FidelityEngine(FakeEngine):
    """Full prefill (use_cache=False) is right; `none` gets the Nile wrong. Words are tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.recovery = Recovery.parse(DEFAULT_RECOVERY)

    def generate(self, prompt: str, *, use_cache: bool = True, recovery: str | None = None, max_new_tokens: int = 20,
                 stop: tuple[str, ...] = (), **sampling) -> Result:
        setting = "full" if not use_cache else str(Recovery.parse(recovery) if recovery else self.recovery)
        nile, ttft = BEHAVIOUR[setting]
        facts = {"Nile": nile, "cats": "purr", "rock": "lava"}
        fact = next(v for key, v in facts.items() if key in prompt.rsplit("<user>", 1)[-1])
        words = f"{PADDING} the answer is {fact}.".split()[:max_new_tokens]
        return Result(" ".join(words), tuple(range(len(words))), "eos", ttft, ttft + 0.1, 100, 90, 10, (), (), ())


@pytest.fixture
def engine(monkeypatch) -> FidelityEngine:
    engine = FidelityEngine()
    monkeypatch.setattr(corpus_mod, "_load_engine", lambda model, store, mode, dtype=None: engine)
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: FakeEmbedder())
    return engine


@pytest.fixture
def setup(tmp_path: Path, engine: FidelityEngine, capsys) -> tuple[Path, Path]:
    docs = write_docs(tmp_path / "docs")
    code, _, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32", "--overlap", "8")
    assert code == 0, err
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    return tmp_path / "c", questions


def test_the_rule_is_one_function() -> None:
    retained = {"none": 0.5, "last:1": 0.96, "last:2": 1.0, "attend:1": None}
    speed = {"none": 40.0, "last:1": 12.0, "last:2": 8.0, "attend:1": 30.0}
    assert fastest_retaining(retained, speed) == "last:1"
    assert fastest_retaining(retained, speed, min_speedup=13.0) is None  # the bench holds its pick to >= 5x this way
    assert fastest_retaining(retained, speed, target=0.99) == "last:2"
    assert fastest_retaining({("isolated", "none"): 0.97}, {("isolated", "none"): 5.0}) == ("isolated", "none")
    assert DEFAULT_NEW_TOKENS == SHOWN_NEW_TOKENS == 64  # --help shows the library's default


def test_eval_recommends_shows_failures_and_judges_the_whole_answer(setup, capsys) -> None:
    corpus, questions = setup
    code, out, err = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1")
    assert code == 0, err
    table = out.splitlines()
    assert table[0] == "3 questions, k=1, 3 with an expected answer" and table[1].startswith("recovery")
    rows = {line.split()[0]: line.split() for line in table[2:5]}
    assert table[5] == ""
    assert list(rows) == ["none", "last:1", DEFAULT_RECOVERY] and rows["none"][1:4] == ["1.00", "0.67", "0.67"]
    # the fact comes 35 words in: judged on the whole answer (64 tokens), full prefill is right on all 3
    assert rows["last:1"][1:4] == ["1.00", "1.00", "1.00"]
    assert re.search(r"recommended: last:1 \(the fastest setting that keeps >= 95% of full prefill's right answers", out)
    assert "last:1: every question as full prefill answers it" in out and "none: 1 question(s) fail" not in out
    code, out, _ = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--verbose")
    assert "none: 1 question(s) fail" in out and "Q: Which way does the Nile flow? (expected: north)" in out
    assert re.search(r"cached: .*the answer is south\.\n\s+full: .*the answer is north\.", out)
    code, out, _ = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--max-new-tokens", "20")
    assert "no recommendation" in out  # cut at 20 tokens no answer states the fact: nothing is measurable


def test_eval_json_has_every_settings_failures(setup, capsys) -> None:
    corpus, questions = setup
    code, out, err = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["recommended"] == "last:1" and report["applied"] is None and report["max_new_tokens"] == 64
    by = {s["recovery"]: s for s in report["settings"]}
    assert [f["question"] for f in by["none"]["failures"]] == ["Which way does the Nile flow?"]
    failure = by["none"]["failures"][0]
    assert failure["expected"] == "north" and failure["cached"].endswith("south.") and failure["full"].endswith("north.")
    assert (failure["full_right"], failure["cached_right"]) == (True, False) and by["last:1"]["failures"] == []


def test_eval_apply_makes_the_choice_the_corpus_recovery(setup, engine: FidelityEngine, capsys) -> None:
    corpus, questions = setup
    assert json.loads(run(capsys, "info", "--corpus", corpus, "--json")[1])["recovery"] is None
    code, out, err = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--apply")
    assert code == 0, err
    assert f"applied: corpus {corpus} now answers with recovery last:1 unless told otherwise" in out
    assert json.loads((corpus / "manifest.json").read_text())["recovery"] == "last:1"
    code, out, _ = run(capsys, "info", "--corpus", corpus)
    assert re.search(r"recovery\s+last:1 \(set by eval --apply\)", out)
    assert json.loads(run(capsys, "info", "--corpus", corpus, "--json")[1])["recovery"] == "last:1"
    # ask, and the engine the corpus loads (what serve's batcher and the adapters call), use it
    engine.recovery = Recovery.parse(DEFAULT_RECOVERY)
    code, _, err = run(capsys, "ask", "--corpus", corpus, "which way does the Nile flow?", "-k", "1")
    assert code == 0, err
    assert engine.sampling["recovery"] == "last:1" and str(engine.recovery) == "last:1"
    run(capsys, "ask", "--corpus", corpus, "which way does the Nile flow?", "-k", "1", "--recovery", "none")
    assert engine.sampling["recovery"] == "none"  # told otherwise
    # no setting kept: --apply refuses (exit 1) and the corpus keeps its recovery
    code, out, err = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--recovery", "none", "--apply")
    assert code == 1 and "nothing applied: no setting keeps >= 95%" in err
    assert json.loads((corpus / "manifest.json").read_text())["recovery"] == "last:1"


def test_manifests_without_recovery_still_read(tmp_path: Path) -> None:
    data = {"name": "rag_x", "model": "m", "fingerprint": "f", "mode": "shared_prefix", "embedder": "e", "dim": 4,
            "chunk_tokens": 256, "overlap": 32, "max_tokens": 512, "index": "flat", "instructions": "i",
            "package_version": "0", "created": 0.0, "updated": 0.0, "format": 1, "dtype": "float32"}
    assert Manifest.from_json(json.dumps(data), "m.json").recovery is None
    assert Manifest.from_json(json.dumps({**data, "recovery": "last:1"}), "m.json").recovery == "last:1"
