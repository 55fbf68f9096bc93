"""The demo's first impression: its questions are answered by one sentence of the reference (checked
against the text here), and the default model, asked them as the demo asks (first paragraph, at most 64
tokens, k = 4), states that sentence's words without being cut off."""

from __future__ import annotations

from pathlib import Path

import pytest

from rag_promptcache.rag.sample import ANSWERS, DEMO_MAX_NEW_TOKENS, DEMO_STOP, QUESTIONS, TOPICS, topic_texts

# The topics of every chunk the demo retrieved for its questions from the whole sample (sources of a
# `make demo` run): the same top-4 chunks come back from these alone, so the prompts are the demo's.
RETRIEVED = ("return", "try", "while", "for", "break", "continue")


def test_every_demo_question_is_answered_by_a_sentence_of_its_topic() -> None:
    assert set(ANSWERS) == set(QUESTIONS) and len(QUESTIONS) == 3
    for question, expected in ANSWERS.items():
        assert expected.topic in TOPICS and expected.topic in RETRIEVED
        text = " ".join(topic_texts([expected.topic])[expected.topic].split())
        assert expected.reference in text, (question, expected.reference)
        assert all(w in expected.reference or w in text for w in expected.states)


@pytest.mark.smollm
def test_the_default_model_answers_the_demo_questions_right(tmp_path: Path) -> None:
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.sample import sample_documents

    c = Corpus.build(sample_documents(RETRIEVED), tmp_path / "demo", progress=False)
    try:
        for question in QUESTIONS:
            answer = c.ask(question, 4, max_new_tokens=DEMO_MAX_NEW_TOKENS, stop=DEMO_STOP)
            assert answer.finish_reason != "length", (question, answer.answer)
            assert all(w in answer.answer for w in ANSWERS[question].states), (question, answer.answer)
    finally:
        c.close()
