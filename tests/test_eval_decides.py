"""`eval` decides: it recommends a setting by the rule the engine default is judged by (the fastest
that retains >= 95% of full prefill's right answers and keeps >= 90% of them, paired, `fidelity.passes`),
shows the questions that fail with the cached and the full answer side by side, judges the whole answer up to
--max-new-tokens (64 by default), and `--apply` makes the choice the corpus's recovery, which `ask`,
the engine the corpus loads (the server and the adapters call it) and `info` then show.

Over a fake engine whose answers and TTFT depend on the recovery: fast, and the expected pick is known."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_cli import run, use_fake_models
from test_rag_corpus import FakeEngine, write_docs

from rag_promptcache.cli.eval_cmd import SHOWN_NEW_TOKENS, SHOWN_ROUNDS
from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
from rag_promptcache.engine.result import Result, Stream
from rag_promptcache.rag import Corpus
from rag_promptcache.rag.evaluation import TIMING_ROUNDS
from rag_promptcache.rag.fidelity import DEFAULT_NEW_TOKENS, fastest_passing, interval, passes
from rag_promptcache.rag.repetition import DEFAULT_NO_REPEAT_NGRAM, repeated_sentence
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

    def stream(self, prompt: str, **sampling) -> Stream:  # what Corpus.ask calls: the same answers
        self.prompts.append(prompt)
        self.sampling = sampling
        result = self.generate(prompt, **sampling)

        def gen():
            yield result.text
            return result

        return Stream(gen())


@pytest.fixture
def engine(monkeypatch) -> FidelityEngine:
    return use_fake_models(monkeypatch, FidelityEngine())


@pytest.fixture
def setup(tmp_path: Path, engine: FidelityEngine, capsys) -> tuple[Path, Path]:
    docs = write_docs(tmp_path / "docs")
    code, _, err = run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32", "--overlap", "8")
    assert code == 0, err
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    return tmp_path / "c", questions


def times(questions: Path, n: int) -> Path:
    """The questions file asked `n` times over: as many more right answers to rest a recommendation on."""
    out = questions.parent / f"{questions.stem}-x{n}.jsonl"
    out.write_text(questions.read_text() * n)
    return out


def test_the_rule_is_one_function() -> None:
    assert passes(0.95, 0.90) and not passes(0.94, 0.94) and not passes(1.1, 0.89) and not passes(None, 1.0)
    scores = {"none": (0.9, 0.5), "links:4": (0.94, 0.92), "last:1": (1.02, 0.91), "last:2": (1.0, 1.0),
              "attend:1": (None, None)}
    speed = {"none": 40.0, "links:4": 20.0, "last:1": 12.0, "last:2": 8.0, "attend:1": 30.0}
    assert fastest_passing(scores, speed) == "last:1"
    assert fastest_passing(scores, speed, min_speedup=13.0) is None  # the bench holds its pick to >= 5x this way
    assert fastest_passing({**scores, "last:1": (1.0, 0.89)}, speed) == "last:2"
    assert fastest_passing({("isolated", "none"): (1.0, 0.97)}, {("isolated", "none"): 5.0}) == ("isolated", "none")
    assert DEFAULT_NEW_TOKENS == SHOWN_NEW_TOKENS == 64  # --help shows the library's default
    assert TIMING_ROUNDS == SHOWN_ROUNDS


def test_eval_recommends_shows_failures_and_judges_the_whole_answer(setup, capsys) -> None:
    corpus, questions = setup
    code, out, err = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1")
    assert code == 0, err
    table = out.splitlines()
    assert table[0] == "3 questions, k=1, 3 with an expected answer; full prefill answers 3 of them right"
    assert table[1].split() == ["recovery", "full", "right", "cached", "right", "kept", "95%", "interval", "retained",
                                "agreement", "speed-up", "rounds"]
    rows = {line.split()[0]: line.split() for line in table[2:5]}
    assert table[5].startswith("kept: of full prefill's right answers") and table[6] == ""
    # counts beside every share, and kept's interval: 2 of 3 says little
    assert list(rows) == ["none", "last:1", DEFAULT_RECOVERY]
    assert rows["none"][1:10] == ["3/3", "2/3", "2/3", "=", "0.67", "0.21-0.94", "2/3", "2/3", "50.0x"]
    # the fact comes 35 words in: judged on the whole answer (64 tokens), full prefill is right on all 3
    assert rows["last:1"][1:7] == ["3/3", "3/3", "3/3", "=", "1.00", "0.44-1.00"]
    assert rows["last:1"][9:] == ["10.0x", "10.0-10.0x"]  # the median over the timing rounds, and their range
    # a plain warning: 3 right answers are too few for a share of them to mean much, and too few to recommend by
    assert "warning: full prefill answered only 3 question(s) right, fewer than 30: kept moves by 0.33" in out
    assert ("no recommendation: full prefill answered only 3 of the 3 questions with an expected answer right, and a "
            "recommendation needs at least 10 right answers to rest on; add questions with expected answers.") in out
    assert "recommended:" not in out and "moved between timing rounds" not in out
    assert "last:1: every question as full prefill answers it" in out and "none: 1 question(s) fail" not in out
    code, out, err = run(capsys, "eval", times(questions, 4), "--corpus", corpus, "-k", "1")
    assert code == 0, err
    assert "warning: full prefill answered only 12 question(s) right, fewer than 30" in out
    assert re.search(r"recommended: last:1 \(the fastest setting that passes the rule \(retained >= 0\.95 and kept >= 0\.90, of "
                     r"full prefill's right answers\)\): "
                     r"it retains 12/12 and keeps 12/12 = 1.00 \(95% interval 0.76-1.00\) at 10.0x\. It rests on 12 right answers of full "
                     r"prefill, too few to be sure \(see the warning\); the speed-up ranged 10.0-10.0x over 3 timing rounds", out)
    code, out, _ = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--verbose")
    assert "none: 1 question(s) fail" in out and 'Q: Which way does the Nile flow? [wrong]\n    expected: "north"' in out
    assert re.search(r"cached: .*the answer is south\.\n\s+full: .*the answer is north\.", out)
    code, out, _ = run(capsys, "eval", times(questions, 4), "--corpus", corpus, "-k", "1", "--max-new-tokens", "20")
    # cut at 20 tokens no answer states the fact: nothing to rest on, and said so
    assert "no recommendation: full prefill answered only 0 of the 12 questions with an expected answer right" in out


def test_eval_json_has_every_settings_failures(setup, capsys) -> None:
    corpus, questions = setup
    code, out, err = run(capsys, "eval", times(questions, 4), "--corpus", corpus, "-k", "1", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["recommended"] == "last:1" and report["applied"] is None and report["max_new_tokens"] == 64
    assert report["no_recommendation"] is None
    by = {s["recovery"]: s for s in report["settings"]}
    assert [f["question"] for f in by["none"]["failures"]] == ["Which way does the Nile flow?"] * 4
    failure = by["none"]["failures"][0]
    assert failure["expected"] == ["north"] and failure["cached"].endswith("south.") and failure["full"].endswith("north.")
    assert (failure["full_right"], failure["cached_right"]) == (True, False) and by["last:1"]["failures"] == []


def test_eval_apply_makes_the_choice_the_corpus_recovery(setup, engine: FidelityEngine, capsys) -> None:
    corpus, questions = setup
    assert json.loads(run(capsys, "info", "--corpus", corpus, "--json")[1])["recovery"] is None
    assert run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--apply")[0] == 1  # 3 answers: none applied
    assert json.loads((corpus / "manifest.json").read_text())["recovery"] is None
    questions = times(questions, 4)
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
    assert code == 1 and "nothing applied: no setting passes the rule (retained >= 0.95 and kept >= 0.90); the closest" in err
    assert json.loads((corpus / "manifest.json").read_text())["recovery"] == "last:1"


def test_manifests_without_recovery_still_read(tmp_path: Path) -> None:
    data = {"name": "rag_x", "model": "m", "fingerprint": "f", "mode": "shared_prefix", "embedder": "e", "dim": 4,
            "chunk_tokens": 256, "overlap": 32, "max_tokens": 512, "index": "flat", "instructions": "i",
            "package_version": "0", "created": 0.0, "updated": 0.0, "format": 1, "dtype": "float32"}
    assert Manifest.from_json(json.dumps(data), "m.json").recovery is None
    assert Manifest.from_json(json.dumps({**data, "recovery": "last:1"}), "m.json").recovery == "last:1"


# full prefill gets the Nile right and the rock wrong; "swap" gets the Nile wrong and the rock right:
# cached right = full right (retained 1.00), yet one of full prefill's right answers is lost (kept 0.67)
SWAP = {"full": {"Nile": "north", "rock": "ice"}, "swap": {"Nile": "south", "rock": "lava"}}


class SwapEngine(FidelityEngine):
    def generate(self, prompt: str, *, use_cache: bool = True, recovery: str | None = None, max_new_tokens: int = 20,
                 stop: tuple[str, ...] = (), **sampling) -> Result:
        setting = "full" if not use_cache else str(Recovery.parse(recovery) if recovery else self.recovery)
        facts = {"cats": "purr", **SWAP["swap" if setting == "none" else "full"]}
        fact = next(v for key, v in facts.items() if key in prompt.rsplit("<user>", 1)[-1])
        ttft = {"full": 0.5, "none": 0.01}.get(setting, 0.1)
        words = f"the answer is {fact}.".split()[:max_new_tokens]
        return Result(" ".join(words), tuple(range(len(words))), "eos", ttft, ttft + 0.1, 100, 90, 10, (), (), ())


def test_the_rule_uses_the_paired_share_not_the_totals(tmp_path: Path, monkeypatch, capsys) -> None:
    engine = use_fake_models(monkeypatch, SwapEngine())
    docs = write_docs(tmp_path / "docs")
    assert run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32", "--overlap", "8")[0] == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS) * 5)
    code, out, err = run(capsys, "eval", questions, "--corpus", tmp_path / "c", "-k", "1", "--json")
    assert code == 0, err
    by = {s["recovery"]: s for s in json.loads(out)["settings"]}
    assert (by["none"]["retained"], round(by["none"]["kept"], 2)) == (1.0, 0.5)  # 10 of full's 10 rights, 5 of them kept
    assert json.loads(out)["recommended"] == "last:1"  # none is fastest and "retains" 1.0, but loses the Nile
    code, out, _ = run(capsys, "eval", questions, "--corpus", tmp_path / "c", "-k", "1", "--recovery", "none", "--apply")
    assert code == 1 and ("no recommendation: no setting passes the rule (retained >= 0.95 and kept >= 0.90); the "
                          "closest, none, retains 10/10 and keeps 5/10 = 0.50 (95% interval 0.24-0.76). Try more settings with --recovery.") in out
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["recovery"] is None


def test_grading_normalises_and_takes_several_answers(tmp_path: Path) -> None:
    from rag_promptcache.rag.fidelity import EvalQuestion, answer_contains, read_questions

    assert answer_contains("The employer pays 7% of salary.", "7 percent")
    assert answer_contains("It is 7 per cent.", "7%") and answer_contains("Seven days a week", "7")
    assert answer_contains("about 1,234 staff", "1234") and answer_contains("ANA LOPEZ is the CFO", "Ana Lopez.")
    assert not answer_contains("17 percent", "7%") and not answer_contains("someone", "one")
    q = tmp_path / "q.jsonl"
    q.write_text('{"question": "Who?", "answer": ["Ana", "the CFO"]}\n{"question": "How much?", "answer": 7}\n')
    many, one = read_questions(q)
    assert many == EvalQuestion("Who?", ("Ana", "the CFO")) and one.answers == ("7",)
    assert many.judge("It is the cfo.") and not many.judge("Bob") and EvalQuestion("x").judge("y") is None
    q.write_text('{"question": "Who?", "answer": []}\n')
    with pytest.raises(ValueError, match="or a list of them"):
        read_questions(q)


def test_every_miss_shows_the_expected_and_the_given_strings(tmp_path: Path, monkeypatch, capsys) -> None:
    engine = use_fake_models(monkeypatch, SwapEngine())
    docs = write_docs(tmp_path / "docs")
    assert run(capsys, "ingest", docs, "--corpus", tmp_path / "c", "--chunk-tokens", "32", "--overlap", "8")[0] == 0
    questions = tmp_path / "q.jsonl"
    rows = [{"question": "What do cats do when content?", "answer": ["Purr.", "meow"]},
            {"question": "What cools into rock?", "answer": "lava"}]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = run(capsys, "eval", questions, "--corpus", tmp_path / "c", "-k", "1", "--recovery", "last:1")
    assert code == 0, err
    # full prefill's own miss is listed with the expected answer and the answer it gave
    assert 'full prefill: 1 question(s) wrong' in out
    assert 'Q: What cools into rock?\n    expected: "lava"\n    full:     the answer is ice.' in out
    code, out, _ = run(capsys, "eval", questions, "--corpus", tmp_path / "c", "-k", "1", "--recovery", "last:1", "--json")
    assert json.loads(out)["full_prefill_wrong"] == [
        {"question": "What cools into rock?", "expected": ["lava"], "full": "the answer is ice."}]


def test_eval_judges_the_answers_ask_gives(setup, engine: FidelityEngine, capsys) -> None:
    # the same prompt and the same repetition control as `ask`: not the bare engine's loops
    corpus, questions = setup
    calls = []
    real = engine.stream
    engine.stream = lambda prompt, **sampling: calls.append((prompt, sampling)) or real(prompt, **sampling)
    code, _, err = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--recovery", "none")
    assert code == 0, err
    judged = {(p, s.get("use_cache", True)): s for p, s in calls if p.endswith("Which way does the Nile flow?</user></prompt>")}
    c = Corpus.open(corpus)
    try:
        asked = c.ask("Which way does the Nile flow?", 1, max_new_tokens=DEFAULT_NEW_TOKENS)
    finally:
        c.close()
    assert set(judged) == {(asked.prompt, False), (asked.prompt, True)}  # full prefill's answer and none's
    for sampling in judged.values():
        assert sampling["no_repeat_ngram"] == DEFAULT_NO_REPEAT_NGRAM and sampling["stop_when"] is repeated_sentence
        assert sampling["max_new_tokens"] == DEFAULT_NEW_TOKENS


def test_enough_right_answers_give_no_warning_and_the_json_has_the_counts(setup, capsys) -> None:
    corpus, questions = setup
    many = questions.parent / "many.jsonl"
    many.write_text(questions.read_text() * 10)  # 30 questions, all right under full prefill
    code, out, err = run(capsys, "eval", many, "--corpus", corpus, "-k", "1", "--recovery", "last:1", "--repeats", "2")
    assert code == 0, err
    assert "warning" not in out and "It rests on 30 right answers of full prefill; the speed-up ranged" in out
    assert "over 2 timing rounds" in out
    code, out, _ = run(capsys, "eval", questions, "--corpus", corpus, "-k", "1", "--json")
    report = json.loads(out)
    assert report["few_answers"] is True and report["timing_rounds"] == TIMING_ROUNDS
    none = next(s for s in report["settings"] if s["recovery"] == "none")
    assert none["kept_counts"] == [2, 3] and [round(x, 2) for x in none["kept_interval"]] == [0.21, 0.94]
    assert none["speedup_rounds"] == [50.0] * TIMING_ROUNDS
    assert run(capsys, "eval", questions, "--corpus", corpus, "--repeats", "0")[0] == 1


class ShakyEngine(FidelityEngine):
    """`none`'s one-token timings alternate between two speeds from one call to the next."""

    calls = 0

    def generate(self, prompt: str, *, use_cache: bool = True, recovery: str | None = None, max_new_tokens: int = 20,
                 **sampling) -> Result:
        out = super().generate(prompt, use_cache=use_cache, recovery=recovery, max_new_tokens=max_new_tokens, **sampling)
        if use_cache and recovery == "none" and max_new_tokens == 1:
            ShakyEngine.calls += 1
            ttft = 0.01 if ShakyEngine.calls % 2 else 0.03
            out = Result(out.text, out.token_ids, out.finish_reason, ttft, ttft, 100, 90, 10, (), (), ())
        return out


def test_timings_that_move_between_rounds_are_flagged(tmp_path: Path, monkeypatch, capsys) -> None:
    engine = use_fake_models(monkeypatch, ShakyEngine())
    assert run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", tmp_path / "c", "--chunk-tokens", "32")[0] == 0
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    code, out, err = run(capsys, "eval", questions, "--corpus", tmp_path / "c", "-k", "1", "--recovery", "none,last:1")
    assert code == 0, err
    # warm-up call 1; rounds of 3 prompts: calls 2-4 (median 0.03), 5-7 (0.01), 8-10 (0.03)
    assert "warning: the speed-ups moved between timing rounds (none 16.7-50.0x)" in out


def test_the_interval_is_honest_at_the_edges() -> None:
    low, high = interval(5, 5)
    assert high == 1.0 and 0.56 < low < 0.57  # 5 of 5 does not mean 1.00 for sure
    assert interval(0, 0) is None and interval(0, 4)[0] == 0.0
    low, high = interval(30, 30)
    assert 0.88 < low < 0.89
