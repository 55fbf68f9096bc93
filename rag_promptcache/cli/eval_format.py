"""How `eval` and `eval --codec` write what they measured: counts beside every share, kept's 95% interval,
the warning where the reference's right answers are few, what a recommendation rests on, and why there is
none, in plain words. One wording for both, so a codec's verdict reads like a recovery's.

Not here: measuring (`rag.fidelity`, `rag.evaluation`, `rag.codec_eval`) or the commands (eval_cmd.py,
eval_codecs.py)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rag_promptcache.rag.fidelity import QuestionResult, SettingReport


def summary_line(num_questions: int, k: int, reference: SettingReport, who_answers: str, setting: str = "") -> str:
    """The first line: how many questions, k, how many with an expected answer and how many of those the
    reference got right ("full prefill answers", "fp16 modules answer")."""
    answered = reference.num_with_answer
    return (f"{num_questions} questions, k={k}{setting}, {answered} with an expected answer"
            + (f"; {who_answers} {reference.full_correct} of them right" if answered else ""))


def kept_text(r: SettingReport) -> str:
    kept, of = r.kept_counts
    return f"{kept}/{of} = {kept / of:.2f}" if of else "n/a"


def interval_text(r: SettingReport) -> str:
    return "n/a" if r.kept_interval is None else "{:.2f}-{:.2f}".format(*r.kept_interval)


def retained_text(r: SettingReport) -> str:
    return f"{r.cached_correct}/{r.full_correct}" if r.num_with_answer else "n/a"


def retains_text(r: SettingReport) -> str:
    """"retains 9/10 and " before a kept share, where there is a retained count to show (expected answers)."""
    return f"retains {retained_text(r)} and " if r.num_with_answer and r.retained is not None else ""


def few(reference: SettingReport) -> bool:
    """Whether the share the rule reads rests on fewer answers than rag.fidelity.MIN_RIGHT."""
    from rag_promptcache.rag.fidelity import MIN_RIGHT

    return reference.kept_counts[1] < MIN_RIGHT


def few_warning(reference: SettingReport, whose: str = "full prefill") -> str | None:
    """The warning under the table where `reference` (full prefill, or fp16 modules) answered fewer than
    MIN_RIGHT right; None where enough did."""
    from rag_promptcache.rag.fidelity import MIN_RIGHT

    if not few(reference):
        return None
    n = reference.kept_counts[1]
    step = f"{1 / n:.2f}" if n else "all"
    if reference.num_with_answer:
        return (f"warning: {whose} answered only {n} question(s) right, fewer than {MIN_RIGHT}: kept moves by {step} "
                f"with each answer and is only known to lie in its 95% interval. Add questions with expected answers "
                f"until {whose} gets {MIN_RIGHT} or more right before trusting the recommendation.")
    return (f"warning: only {n} question(s), fewer than {MIN_RIGHT}: agreement moves by {step} with each answer "
            f"and is only known to lie in its 95% interval. Ask {MIN_RIGHT} or more before trusting the recommendation.")


def rests_on(r: SettingReport, whose: str = "full prefill", timing: str | None = None) -> str:
    """What a recommendation rests on: how many answers (and, for a recovery, how steady its speed-up was)."""
    n = r.kept_counts[1]
    what = f"{n} right answers of {whose}" if r.num_with_answer else f"{n} questions (no expected answers: agreement)"
    return f"It rests on {what}{', too few to be sure (see the warning)' if few(r) else ''}{'; ' + timing if timing else ''}"


def no_recommendation(reference: SettingReport, closest: SettingReport | None, target: str, what: str,
                      whose: str = "full prefill", hint: str = "") -> str:
    """Why nothing is recommended, plainly: too few answers to rest on (`fidelity.too_few`), or no `what`
    (setting, codec) meets `target`, with the closest one's share and `hint`, what to try next."""
    from rag_promptcache.rag.fidelity import too_few

    why = too_few(reference, whose)
    if why is not None:
        return f"no recommendation: {why}."
    # a codec's report carries the codec's name where a recovery's carries the recovery (rag.codec_eval)
    near = "" if closest is None else (f"; the closest, {closest.recovery}, {retains_text(closest)}keeps "
                                       f"{kept_text(closest)} (95% interval {interval_text(closest)})")
    return f"no recommendation: no {what} {target}{near}." + (f" {hint}" if hint else "")


def expected_text(answers: tuple[str, ...]) -> str:
    return " or ".join(json.dumps(a) for a in answers)


def one_line(text: str) -> str:
    return " ".join(text.split()) or "(empty)"


def miss_text(f: QuestionResult, lines: list[tuple[str, str]], why: str | None = None) -> str:
    """One failing question: Q, the expected answer, then `lines` of (who, answer), each answer on one line."""
    expected = f"\n    expected: {expected_text(f.expected)}" if f.expected is not None else ""
    body = "".join(f"\n    {who + ':':<9} {one_line(text)}" for who, text in lines)
    return f"  Q: {f.question}{f' [{why}]' if why else ''}{expected}{body}"
