"""Fidelity rows judged against another run's full prefill: a tuned model's answers against the base
model's full-prefill answers to the same questions (issue 34's reference: what a user gets without this
library), while speed-ups stay against the measured model's own full prefill.

`load` reads a run's fidelity.json (`python -m benchmarks.fidelity ... --out DIR`, the base
model: `--adapter none`); `check` refuses a reference that asked other questions (another split, k,
seed offset or question count), and `check_prompts` one whose prompts were others (the corpus or the prompt's
format changed since it ran: its answers are then to other prompts, and judging against them measures the
change, not the cache); `apply` rewrites one row's `retained` and `kept` against it, keeping
the row's own in `own_retained` and `own_kept` (`rejudge`: a whole report's rows, against a reference made
since); `row` makes one setting's row (the bench's and the
research probes') and applies the reference where there is one. Not here: running the model
(bench/fidelity.py).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rag_promptcache.rag.fidelity import SettingReport

BASE = "none"  # the adapter label of the base model


def adapter_label(model: torch.nn.Module) -> str:
    """Which adapter is merged into `model`: its directory's name and digest, or "none" for the base model."""
    from rag_promptcache.model.adapter import applied

    adapter = applied(model)
    return BASE if adapter is None else f"{adapter.name}@{adapter.digest}"


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    """One run's full-prefill answers, per (split, k): (question, expected answers, right) in question order."""

    path: str
    adapter: str  # the adapter that run's model carried
    answers: dict[tuple[str, int], tuple[tuple[str, tuple[str, ...], bool], ...]]
    # per (split, k), each question's prompt digest (rag/fidelity.py `prompt_digest`); absent: a report written
    # before they were kept, whose prompts cannot be checked
    prompts: dict[tuple[str, int], tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def held(self) -> str:
        return ", ".join(f"{s} k={k}" for s, k in sorted(self.answers)) or "nothing"


def load(path: str | Path) -> ReferenceRun:
    """A fidelity.json's full-prefill answers. Raises ValueError for a file that is not one run's report
    with per-question answers (a pooled report has none)."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"reference {str(path)!r} is not a readable fidelity.json: {e}") from e
    rows = report.get("rows") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"reference {str(path)!r} holds no fidelity rows; pass the fidelity.json of a run of "
                         "python -m benchmarks.fidelity")
    if "runs" in report or any("answers" not in r for r in rows):
        raise ValueError(f"reference {str(path)!r} has no per-question answers (a pooled report has none); "
                         "pass one run's own fidelity.json")
    answers: dict[tuple[str, int], tuple[tuple[str, tuple[str, ...], bool], ...]] = {}
    prompts: dict[tuple[str, int], tuple[str, ...]] = {}
    adapters = {r.get("adapter", BASE) for r in rows}
    if len(adapters) != 1:
        raise ValueError(f"reference {str(path)!r} mixes adapters {sorted(adapters)}; pass one model's run")
    for r in rows:
        per = tuple((a["question"], _expected(a["expected"]), bool(a["full_right"])) for a in r["answers"])
        key = (r.get("split", "bench"), r["k"])
        if answers.setdefault(key, per) != per:
            raise ValueError(f"reference {str(path)!r}: the rows of {key[0]} k={key[1]} disagree on full "
                             "prefill's answers; it is not one run's report")
        if all("prompt" in a for a in r["answers"]):
            prompts[key] = tuple(a["prompt"] for a in r["answers"])
    return ReferenceRun(str(path), adapters.pop(), answers, prompts)


def _expected(value: str | list[str] | None) -> tuple[str, ...]:
    """A row's expected answers: a list, or (in reports written before answers could be several) one string."""
    return (value,) if isinstance(value, str) else tuple(value or ())


def check(ref: ReferenceRun, questions: dict[str, list[tuple[str, tuple[str, ...]]]], ks: tuple[int, ...]) -> None:
    """Refuse a reference that did not ask this run's questions: `questions` maps each split to its
    (question, expected answers) in order; every split must be in the reference at every k in `ks`."""
    hint = "run the reference with the same --split, --k, --questions and --seed-offset"
    for split, mine in questions.items():
        for k in ks:
            theirs = ref.answers.get((split, k))
            if theirs is None:
                raise ValueError(f"reference {ref.path!r} holds no answers for split {split!r} at k={k} (it holds: "
                                 f"{ref.held()}); {hint}")
            theirs_q = [(q, e) for q, e, _ in theirs]
            if theirs_q != mine:
                at = next((i for i, (a, b) in enumerate(zip(theirs_q, mine)) if a != b), min(len(mine), len(theirs_q)))
                if at >= min(len(mine), len(theirs_q)):
                    what = f"{len(theirs_q)} questions there, {len(mine)} here"
                elif theirs_q[at][0] == mine[at][0]:
                    what = f"question {at + 1} expects {list(theirs_q[at][1])} there, {list(mine[at][1])} here"
                else:
                    what = f"question {at + 1} is {theirs_q[at][0]!r} there, {mine[at][0]!r} here"
                raise ValueError(f"reference {ref.path!r} asked other questions for split {split!r} at k={k} "
                                 f"({what}); {hint}")


def check_prompts(ref: ReferenceRun, split: str, k: int, digests: Sequence[str]) -> str:
    """Refuse (ValueError) a reference whose prompts for `split` at `k` were not this run's (`digests`, in
    question order): its full prefill answered other prompts. → a warning where the reference kept no
    digests (a report written before they were), else ''."""
    theirs = ref.prompts.get((split, k))
    if theirs is None:
        return (f"reference {ref.path!r} keeps no prompt digests for {split} k={k}: whether its prompts are this "
                "run's cannot be checked")
    differ = [i for i, (a, b) in enumerate(zip(theirs, digests)) if a != b]
    if differ or len(theirs) != len(digests):
        raise ValueError(f"reference {ref.path!r} answered other prompts for split {split!r} at k={k} ({len(differ)} "
                         f"of {len(digests)} differ, the first at question {(differ or [len(theirs)])[0] + 1}): the corpus "
                         "or the prompt's format changed since it ran; make a new one with --adapter none")
    return ""


def row(split: str, adapter: str, mode: str, codec: str, report: SettingReport, reference: ReferenceRun | None,
        **extra: object) -> dict[str, object]:
    """One setting's fidelity row at one split and k: `report`'s counts, `extra` (its recomputed share, a
    probe's own columns), its per-question answers; judged against `reference` where one is given."""
    out = {"split": split, "adapter": adapter, "mode": mode, "codec": codec, **report.as_dict(), **extra,
           "answers": [a.as_dict() for a in report.results]}
    return out if reference is None else apply(out, reference)


def apply(row: dict[str, object], ref: ReferenceRun) -> dict[str, object]:
    """`row` (one setting at one split and k, with its per-question answers) judged against the reference's
    full prefill: `retained` = cached right / the reference's right, `kept` = of the reference's right
    answers, the share the setting also gets right. The row's own, against its model's full prefill,
    move to `own_retained` and `own_kept`; `reference_full_correct` is the reference's count."""
    theirs = ref.answers[(row.get("split", "bench"), row["k"])]
    answers = row["answers"]
    assert [a["question"] for a in answers] == [q for q, _, _ in theirs], f"{row['k']=} {ref.path=}"
    judged = [(a, right) for a, (_, expected, right) in zip(answers, theirs) if expected]
    base = sum(right for _, right in judged)
    for a, (_, _, right) in zip(answers, theirs):
        a["reference_right"] = right
    both = sum(bool(a["cached_right"]) and right for a, right in judged)
    row.update({"own_retained": row["retained"], "own_kept": row["kept"], "reference_full_correct": base,
                "retained": row["cached_correct"] / base if base else None, "kept": both / base if base else None})
    return row


def rejudge(run: dict[str, object], ref: ReferenceRun) -> dict[str, object]:
    """A run's report (its fidelity.json) with every row judged anew against `ref`, a reference made since over
    the same questions (and prompts, where both kept their digests): no model runs. A row judged before gets
    its own measures back first, so `own_*` stay against its own full prefill."""
    rows = []
    for r in run["rows"]:  # type: ignore[union-attr]
        r = copy.deepcopy(r)
        if "own_retained" in r:
            r["retained"], r["kept"] = r.pop("own_retained"), r.pop("own_kept")
            r.pop("reference_full_correct", None)
        split, k = r.get("split", "bench"), r["k"]
        check(ref, {split: [(a["question"], _expected(a["expected"])) for a in r["answers"]]}, (k,))
        if all("prompt" in a for a in r["answers"]) and (split, k) in ref.prompts:
            check_prompts(ref, split, k, [a["prompt"] for a in r["answers"]])
        rows.append(apply(r, ref))
    return {**run, "rows": rows, "reference": {"path": ref.path, "adapter": ref.adapter},
            "full_prefill_against_reference": full_prefill_against(rows)}


def full_prefill_against(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Per split and k, this model's full-prefill right answers beside the reference's (the target: at
    least as many), from rows `apply` judged."""
    out: dict[tuple[str, int], dict[str, object]] = {}
    for r in rows:
        if "reference_full_correct" in r:
            out.setdefault((r.get("split", "bench"), r["k"]), {
                "split": r.get("split", "bench"), "k": r["k"], "adapter": r.get("adapter", BASE),
                "full_correct": r["full_correct"], "reference_full_correct": r["reference_full_correct"],
                "with_answer": r["with_answer"], "at_least_as_many": r["full_correct"] >= r["reference_full_correct"]})
    return list(out.values())
