"""Grading probe answers as the fidelity benchmark grades them: the first sentence, the fact as a
whole word, and `kept` against the base model's full prefill."""

from __future__ import annotations

from research.tune_probe import cut, grade


def test_cut_and_grade() -> None:
    assert cut("It opened in 1877. Later, 1900.") == "It opened in 1877."
    rows = [{"split": "bench", "k": 4, "answer": "1877"}, {"split": "bench", "k": 4, "answer": "Ines"},
            {"split": "heldout", "k": 4, "answer": "12"}]
    answers = {"base/full": ["In 1877.", "Ines Varga leads it.", "About 12."],
               "base/none": ["In 1877.", "Omar leads it. Ines too.", "About 12."],
               "tuned/none": ["In 1902.", "Ines.", "12 of them."]}
    out = {(r["split"], r["setting"]): r for r in grade(rows, answers)}
    assert out[("bench", "base/full")]["right"] == 2 and out[("bench", "base/full")]["kept"] == 1.0
    assert out[("bench", "base/none")]["right"] == 1 and out[("bench", "base/none")]["kept"] == 0.5
    assert out[("bench", "tuned/none")]["kept"] == 0.5 and out[("heldout", "tuned/none")]["retained"] == 1.0
