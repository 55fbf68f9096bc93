"""`rag-promptcache tune` on a fresh corpus, as a user runs it (a real process, a tiny random Llama
with SmolLM2's tokenizer, the real embedder and FAISS): it trains, checks (on questions it makes, or
the user's), resumes, and refuses to apply an adapter that does not help; the questions it makes and
the verdict's rule on their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_promptcache.model import adapter as adapters
from rag_promptcache.rag import Corpus
from rag_promptcache.rag.fidelity import EvalQuestion
from rag_promptcache.tune.check import Check, CheckQuestion, blanks, judge, made_questions, phrase, too_few_to_judge, verdict
from rag_promptcache.tune.corpus import tune_corpus
from rag_promptcache.tune.train import TuneConfig
from tests.tiny_adapter import save_random_lora
from tests.test_cli import assert_user_error, run
from tests.test_cli_failures import cli
from tests.tiny_llama import save_tiny_llama

DOCS = {f"team-{i}.md": f"Team {name} meets on {day}. Its lead is {lead}, who joined in {2010 + i}. "
        f"The team owns the {thing} service and reports to the {dept} department every {day}.\n\n"
        f"Budget requests from team {name} go to {lead} before the end of each quarter, in writing."
        for i, (name, day, lead, thing, dept) in enumerate([
            ("Amber", "Monday", "Ines Varga", "billing", "finance"), ("Birch", "Tuesday", "Omar Haddad", "search", "product"),
            ("Cobalt", "Wednesday", "Lena Brandt", "login", "security"), ("Dune", "Thursday", "Raj Mehta", "export", "data"),
            ("Ember", "Friday", "Sofia Lund", "mail", "operations"), ("Fjord", "Monday", "Tomas Novak", "upload", "platform")])}


@pytest.mark.slow
def test_tune_trains_checks_resumes_and_does_not_apply_what_does_not_help(tmp_path: Path, monkeypatch, capsys) -> None:
    model = save_tiny_llama(tmp_path / "tiny")
    docs = tmp_path / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text)
    built = cli("ingest", docs, "-c", tmp_path / "c", "--model", model, timeout=300)
    assert built.returncode == 0, built.stderr
    # the refusal before training and the resume run in this process (the same command, without two more
    # start-ups of a process that loads the model); the ingest and the training tune are real processes
    code, out, err = run(capsys, "tune", "-c", tmp_path / "c", "--steps", "2", "--check", "3", "--corpus-only", "--json")
    assert code == 0, err
    report = json.loads(out)
    # a random model answers none of the questions made from the corpus: said before training, nothing trained
    assert report["steps"] == 0 and report["applied"] is False
    assert "nothing was trained" in report["reason"] and "--questions" in report["reason"]
    assert set(report["check"]["right"]) == {"base/full", "base/none"} and report["check"]["right"]["base/full"] == 0
    assert set(report["check"]["kinds"]) == {"blank"} and report["check"]["questions"] == 3
    assert not (tmp_path / "c" / "tuned" / "adapter_model.safetensors").exists()
    done = cli("tune", "-c", tmp_path / "c", "--steps", "2", "--check", "0", "--corpus-only", "--json", timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["steps"] == 2 and report["adapter"] == str(tmp_path / "c" / "tuned") and report["applied"] is True
    meta = json.loads((tmp_path / "c" / "tuned" / "tune.json").read_text())
    assert meta["mode"] == "shared_prefix" and meta["recovery"] == "none"
    assert (tmp_path / "c" / "tuned" / "adapter_model.safetensors").exists()
    code, out, err = run(capsys, "tune", "-c", tmp_path / "c", "--steps", "3", "--check", "0", "--corpus-only")
    assert code == 0, err
    assert "trained 3 steps" in out and "applied unchecked" in out  # resumed from step 2
    # bad input, in this process too (the same command, without five more start-ups)
    (tmp_path / "bad.jsonl").write_text('{"question": "Who leads Amber?"}\n{"answer": "x"}\n')
    for args, why in [(("--minutes", "0"), "--minutes must be > 0"), (("-k", "0"), "-k must be at least 1"),
                      (("--links", "-1"), "--links must be >= 0, got -1"),
                      (("--questions", tmp_path / "missing.jsonl"), "no such file"),
                      (("--questions", tmp_path / "bad.jsonl"), "bad.jsonl:2")]:
        assert_user_error(run(capsys, "tune", "-c", tmp_path / "c", *args), why)
    # where an adapter ships for the model, a tune starts from it and is checked against it too; here on
    # the user's questions, one without an expected answer (right: what the base model's full prefill says)
    shipped = adapters.read(save_random_lora(model, tmp_path / "shipped", recovery="last:1"))
    monkeypatch.setattr(adapters, "find", lambda spec, name: shipped if spec == adapters.DEFAULT else None)
    corpus = Corpus.open(tmp_path / "c")
    heard = []
    try:
        report = tune_corpus(corpus, tmp_path / "from-shipped", TuneConfig(
            rank=4, alpha=8, targets=("q_proj", "k_proj", "v_proj", "o_proj"), max_steps=1, tokens_per_batch=2048),
            general=False, questions=[EvalQuestion("Who leads team Amber?", ("Ines Varga",)),
                                      EvalQuestion("When does team Birch meet?")],
            phase=lambda name, models: heard.append((name, models)))
    finally:
        corpus.close()
    # the progress bar hears each phase: the base model and the shipped adapter checked before, the tuned one after
    assert heard == [("checking before", 2), ("training", 0), ("checking after", 1)]
    assert {"default/full", "default/none"} <= set(report.check.right)
    assert report.check.kinds == {"user": 2} and report.check.right["base/full"] >= 1
    meta = json.loads((tmp_path / "from-shipped" / "tune.json").read_text())
    assert meta["recipe"]["init"] == shipped.path and meta["recovery"] == shipped.recovery
    # another rank cannot start from the shipped weights: a fresh LoRA, still checked against them
    corpus = Corpus.open(tmp_path / "c")
    try:
        tune_corpus(corpus, tmp_path / "rank-8", TuneConfig(rank=8, alpha=16, max_steps=1, tokens_per_batch=2048),
                    general=False, check=0)
    finally:
        corpus.close()
    assert json.loads((tmp_path / "rank-8" / "tune.json").read_text())["recipe"]["init"] == ""


def test_check_questions_blank_a_fact_that_tells_look_alikes_apart() -> None:
    text = ("The Ostsarsar hospital has 780 beds. Its main span is 395 metres long. "
            "Its first chief physician at Ostsarsar was Dr Kendrick.\nThe team owns the billing service.")
    assert blanks(text) == [("The Ostsarsar hospital has ___ beds.", "780"),  # 395: nothing says whose span
                            ("Its first chief physician at Ostsarsar was Dr ___.", "Kendrick")]
    made = made_questions([text, "Version 2.1 of the tool was released in 2019 by the team."], 4, seed=0)
    assert sorted((a, kind) for _, a, kind in made) == [("2.1", "blank"), ("780", "blank"), ("Kendrick", "blank")]
    assert [q for q, a, _ in made if a == "2.1"][0].endswith('this sentence from the documents: '
                                                           '"Version ___ of the tool was released in 2019 by the team."')
    assert made[1][1] == "2.1"  # one from each text in turn
    # a text with no such sentence still gets a cloze question; none at all for one too short to ask about
    made = made_questions(["the quick brown fox jumps over the lazy dog and then runs far away into the woods.", "Hi."], 4, 0)
    assert [kind for _, _, kind in made] == ["cloze"]


def test_judge_without_an_expected_answer_compares_with_the_base_models_full_prefill() -> None:
    rows = [CheckQuestion("q1", ("780",), (), "", "user"), CheckQuestion("q2", (), (), "", "user")]
    texts = {"base/full": ["It has 780 beds.", "On Monday."], "tuned/none": ["It has 781 beds.", "on monday"]}
    assert judge(rows, texts) == {"base/full": [True, True], "tuned/none": [False, True]}


def test_verdict() -> None:
    def check(base_full: int, tuned_full: int, base_none: float, tuned_none: float) -> Check:
        return Check(10, {"base/full": base_full, "base/none": 3, "tuned/full": tuned_full, "tuned/none": 5},
                     {"base/full": 1.0, "base/none": base_none, "tuned/full": 1.0, "tuned/none": tuned_none},
                     {"blank": 10})

    assert verdict(check(8, 8, 0.5, 0.75))[0] is True
    ok, why = verdict(check(8, 7, 0.5, 0.75))
    assert not ok and "full prefill got worse" in why
    ok, why = verdict(check(8, 8, 0.5, 0.5))
    assert not ok and "did not get better" in why
    # where an adapter ships, the tuned one must beat it, not only the base model
    shipped = check(8, 8, 0.5, 0.75)
    shipped.right["default/none"], shipped.kept["default/none"] = 6, 0.8
    ok, why = verdict(shipped)
    assert not ok and "the shipped adapter's 0.80" in why


def test_too_few_right_answers_to_judge_is_said_before_training() -> None:
    rows = [CheckQuestion(f"q{i}", (str(100 + i),), (), "", "blank") for i in range(6)]

    def said(n_right: int, rows=rows) -> dict[str, list[str]]:
        return {"base/full": [f"It is {100 + i}." if i < n_right else "I do not know." for i in range(len(rows))]}

    why = too_few_to_judge(rows, said(2))
    assert why is not None and "answered 2 of the 6 check questions" in why and "--questions" in why and "--check 0" in why
    assert too_few_to_judge(rows, said(3)) is None
    many = rows * 2  # 3 of 12: fewer than a third
    assert "3 of the 12" in too_few_to_judge(many, said(3, many))


def test_check_questions_can_be_asked_as_a_continuation() -> None:
    sentence = "By default the checkpoint runs when the log reaches ___ pages."
    assert phrase(sentence, "continue") == ('According to the documents, how does this go on (one word or number): '
                                            '"By default the checkpoint runs when the log reaches ..."?')
    assert phrase(sentence, "blank").endswith(f'"{sentence}"')
