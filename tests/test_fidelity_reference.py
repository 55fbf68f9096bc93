"""Tuned rows judged against the base model's full prefill (bench/fidelity_reference.py, `--adapter` and
`--reference` of bench/fidelity.py): retained and kept against the reference's answers per question, the
model's own beside them, a reference over other questions refused, pooling kept working. End to end on
a tiny random Llama with a random LoRA: its answers are noise, the bookkeeping is what is checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rag_promptcache.bench import report
from benchmarks.fidelity import main, pool
from rag_promptcache.bench.fidelity_reference import ReferenceRun, apply, check, check_prompts, load, rejudge
from tests.tiny_adapter import save_random_lora
from tests.tiny_llama import save_tiny_llama


def row(k, answers, split="manuals", adapter="tuned@0123"):
    """One setting's row as the scenario writes it; `answers`: (own full right, cached right) per question."""
    full, cached = sum(f for f, _ in answers), sum(c for _, c in answers)
    return {"split": split, "k": k, "adapter": adapter, "mode": "shared_prefix", "recovery": "none", "questions": len(answers),
            "with_answer": len(answers), "full_correct": full, "cached_correct": cached,
            "retained": cached / full if full else None, "kept": None, "agreement": 0.5, "recomputed_share": 0.0,
            "context_tokens": 100.0, "full_ttft_s": 1.0, "cached_ttft_s": 0.1,
            "answers": [{"question": f"q{i}", "expected": [str(i)], "full_right": f, "cached_right": c}
                        for i, (f, c) in enumerate(answers)]}


def reference(rights, k=4, split="manuals"):
    return ReferenceRun("base.json", "none", {(split, k): tuple((f"q{i}", (str(i),), r) for i, r in enumerate(rights))})


def test_retained_and_kept_are_against_the_reference_and_the_own_stay_beside():
    # own full prefill right on q0 and q1; the base's on q1, q2 and q3; the cache right on q1 and q2
    r = apply(row(4, [(1, 0), (1, 1), (0, 1), (0, 0)]), reference([False, True, True, True]))
    assert (r["full_correct"], r["reference_full_correct"], r["cached_correct"]) == (2, 3, 2)
    assert r["retained"] == 2 / 3 and r["kept"] == 2 / 3 and r["own_retained"] == 1.0
    assert [a["reference_right"] for a in r["answers"]] == [False, True, True, True]


def test_a_reference_over_other_questions_is_refused():
    ref = reference([True, False])
    check(ref, {"manuals": [("q0", ("0",)), ("q1", ("1",))]}, (4,))
    for questions, ks, match in [
        ({"manuals": [("q0", ("0",)), ("q1", ("1",))]}, (4, 8), "no answers for split 'manuals' at k=8 .*holds: manuals k=4"),
        ({"bench": [("q0", ("0",))]}, (4,), "no answers for split 'bench'"),
        ({"manuals": [("q0", ("0",)), ("other", ("1",))]}, (4,), "question 2 is 'q1' there, 'other' here"),
        ({"manuals": [("q0", ("0",)), ("q1", ("7",))]}, (4,), r"question 2 expects \['1'\] there, \['7'\] here"),
        ({"manuals": [("q0", ("0",))]}, (4,), "2 questions there, 1 here"),
    ]:
        with pytest.raises(ValueError, match=match) as e:
            check(ref, questions, ks)
        assert "--seed-offset" in str(e.value)


def test_a_reference_over_other_prompts_is_refused_and_one_without_digests_is_named(tmp_path):
    base = row(4, [(1, 1), (0, 0), (1, 0)], adapter="none")
    for a, digest in zip(base["answers"], ["aa", "bb", "cc"]):
        a["prompt"] = digest
    (tmp_path / "base.json").write_text(json.dumps({"rows": [base]}))
    ref = load(tmp_path / "base.json")
    assert check_prompts(ref, "manuals", 4, ["aa", "bb", "cc"]) == ""
    # a chunk's header changed since the reference ran: two of its prompts are others
    with pytest.raises(ValueError, match=r"answered other prompts for split 'manuals' at k=4 \(2 of 3 differ, the "
                                         r"first at question 2\).*--adapter none"):
        check_prompts(ref, "manuals", 4, ["aa", "xx", "yy"])
    with pytest.raises(ValueError, match="1 of 3 differ, the first at question 3"):
        check_prompts(ref, "manuals", 4, ["aa", "bb", "zz"])
    # written before prompts were kept: judged as before, and said so
    assert "keeps no prompt digests for manuals k=4" in check_prompts(reference([True, False, True]), "manuals", 4,
                                                                       ["aa", "bb", "cc"])


def test_a_run_is_judged_anew_against_a_reference_made_since(tmp_path):
    # judged against an old reference (right on q0 only), then against a new one (right on q1 and q2)
    own = {**row(4, [(1, 1), (1, 1), (0, 0)]), "kept": 1.0, "speedup": 10.0}
    run = {"adapter": "tuned@0123", "rows": [apply(own, reference([True, False, False]))]}
    assert run["rows"][0]["kept"] == 1.0
    new = rejudge(run, reference([False, True, True]))
    r = new["rows"][0]
    assert (r["reference_full_correct"], r["kept"], r["retained"]) == (2, 0.5, 1.0)
    assert (r["own_kept"], r["own_retained"]) == (1.0, 1.0)  # still against its own full prefill
    assert [a["reference_right"] for a in r["answers"]] == [False, True, True]
    assert new["reference"] == {"path": "base.json", "adapter": "none"} and run["rows"][0]["kept"] == 1.0  # a copy
    with pytest.raises(ValueError, match="asked other questions"):
        rejudge(run, ReferenceRun("b.json", "none", {("manuals", 4): (("q9", ("0",), True),) * 3}))
    # both kept prompt digests, and they differ: refused
    for a in run["rows"][0]["answers"]:
        a["prompt"] = "aa"
    other = ReferenceRun("b.json", "none", reference([True, True, True]).answers, {("manuals", 4): ("aa", "bb", "aa")})
    with pytest.raises(ValueError, match="answered other prompts"):
        rejudge(run, other)
    main(["--rejudge", str(_write(tmp_path / "run.json", run)), "--reference",
          str(_write(tmp_path / "ref.json", {"rows": [row(4, [(1, 0), (0, 0), (1, 0)], adapter="none")]})),
          "--out", str(tmp_path / "out")])
    assert json.loads((tmp_path / "out" / "fidelity.json").read_text())["rows"][0]["reference_full_correct"] == 2


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


def test_a_report_written_when_answers_were_one_string_is_read(tmp_path):
    old = row(4, [(1, 1), (0, 0)], split="bench", adapter="none")
    for a in old["answers"]:
        a["expected"] = a["expected"][0]  # reports before several answers were allowed wrote one string
    (tmp_path / "old.json").write_text(json.dumps({"rows": [old]}))
    ref = load(tmp_path / "old.json")
    assert ref.answers[("bench", 4)] == (("q0", ("0",), True), ("q1", ("1",), False))
    check(ref, {"bench": [("q0", ("0",)), ("q1", ("1",))]}, (4,))


def test_a_pooled_or_unreadable_reference_is_refused(tmp_path):
    pooled = tmp_path / "pooled.json"
    pooled.write_text(json.dumps(pool([{"rows": [row(4, [(1, 1)])]}])))
    with pytest.raises(ValueError, match="no per-question answers .*pooled"):
        load(pooled)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not a readable fidelity.json"):
        load(tmp_path / "bad.json")


def test_pool_keeps_the_reference_and_keeps_adapters_apart():
    a = apply(row(4, [(1, 0), (1, 1)]), reference([True, True]))
    b = apply(row(4, [(0, 1), (1, 1)]), reference([False, True]))
    base = row(4, [(1, 1), (1, 0)], adapter="none")
    pooled = pool([{"rows": [a, base]}, {"rows": [b]}])
    got = {r["adapter"]: r for r in pooled["rows"]}
    tuned = got["tuned@0123"]
    assert (tuned["reference_full_correct"], tuned["full_correct"], tuned["cached_correct"]) == (3, 3, 3)
    assert tuned["retained"] == 1.0 and tuned["kept"] == 2 / 3 and tuned["own_kept"] == 2 / 3
    assert "reference_full_correct" not in got["none"] and got["none"]["kept"] == 0.5
    assert pooled["full_prefill_against_reference"][0]["at_least_as_many"] is True
    with pytest.raises(ValueError, match="judged against a reference"):
        pool([{"rows": [apply(row(4, [(1, 1)]), reference([True]))]}, {"rows": [row(4, [(1, 1)])]}])


@pytest.fixture(scope="module")
def tiny_base_run(tmp_path_factory):
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    lora = save_random_lora(model, tmp_path_factory.mktemp("adapters") / "tuned")
    out = tmp_path_factory.mktemp("runs")
    args = ["--model", model, "--split", "manuals", "--per-kind", "1", "--k", "2", "--questions", "3",
            "--new-tokens", "2", "--settings", "none,last:9", "--dtype", "float32", "--threads", "2"]
    main([*args, "--adapter", "none", "--out", str(out / "base")])
    return args, lora, out


@pytest.mark.slow  # the scenario's command twice, over a real embedder and corpus
def test_tuned_rows_against_the_base_run_end_to_end(tiny_base_run, capsys):
    args, lora, out = tiny_base_run
    base = json.loads((out / "base" / "fidelity.json").read_text())
    assert base["adapter"] == "none" and {r["adapter"] for r in base["rows"]} == {"none"}
    tuned = main([*args, "--adapter", str(lora), "--reference", str(out / "base" / "fidelity.json"),
                  "--out", str(out / "tuned")])
    label = tuned["adapter"]
    assert label.startswith("tuned@") and {r["adapter"] for r in tuned["rows"]} == {label}
    assert tuned["reference"] == {"path": str(out / "base" / "fidelity.json"), "adapter": "none"}
    # both answered the same prompts: each question's digest is kept, and they agree
    assert all(a["prompt"] == b["prompt"] for r in tuned["rows"] for a, b in zip(r["answers"], base["rows"][0]["answers"]))
    base_full = {r["recovery"]: r["full_correct"] for r in base["rows"]}
    for r in tuned["rows"]:
        assert r["reference_full_correct"] == base_full[r["recovery"]]
        assert [a["reference_right"] for a in r["answers"]] == [a["full_right"] for a in base["rows"][0]["answers"]]
        if r["reference_full_correct"]:
            assert r["retained"] == r["cached_correct"] / r["reference_full_correct"]
    against = tuned["full_prefill_against_reference"]
    assert [(a["split"], a["k"]) for a in against] == [("manuals", 2)]
    md = (out / "tuned" / "fidelity.md").read_text()
    assert "reference full right" in md and "this model against the reference" in md and f"{label}: shared_prefix/none" in md
    pooled = main(["--pool", str(out / "tuned" / "fidelity.json"), str(out / "base" / "fidelity.json"),
                   "--out", str(out / "pooled")])
    assert {r["adapter"] for r in pooled["rows"]} == {label, "none"}
    # other questions (another draw, another k, another split) are refused before the model loads
    for extra, match in [(["--seed-offset", "1"], "asked other questions for split 'manuals' at k=2"),
                         (["--k", "3"], "no answers for split 'manuals' at k=3"),
                         (["--split", "heldout"], "no answers for split 'heldout'")]:
        with pytest.raises(SystemExit):
            main([*args, *extra, "--adapter", str(lora), "--reference", str(out / "base" / "fidelity.json"),
                  "--out", str(out / "refused")])
        assert match in capsys.readouterr().err
    assert not (out / "refused").exists()
