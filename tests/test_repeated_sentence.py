"""The stop at a repeated sentence (issue 25, item 13): a pure function of the decoded text, so it
is tested on strings; the decode loop calls it like its stop-string check."""

from __future__ import annotations

import pytest

from rag_promptcache.rag.repetition import MIN_REPEATED_WORDS, Repeat, repeated_sentence

LOOP = "The tower is in Paris. It was built in 1889. The tower is in Paris. It was built in 1889. "


def test_a_whole_repeated_sentence_ends_the_answer_before_the_repeat() -> None:
    r = repeated_sentence(LOOP)
    assert LOOP[: r.cut] == "The tower is in Paris. It was built in 1889."
    assert r.safe == r.cut


def test_each_prefix_streams_nothing_of_the_repeat() -> None:
    """Fed token by token (here: character by character), nothing after the first sentence pair is
    ever safe to emit, and the cut comes as soon as the repeated sentence is complete."""
    first_pair = len("The tower is in Paris. It was built in 1889.")
    cut_at = None
    for end in range(1, len(LOOP) + 1):
        r = repeated_sentence(LOOP[:end])
        if end > first_pair + 1:
            assert r.safe <= first_pair, (LOOP[:end], r)
        if r.cut is not None:
            cut_at = end
            break
    assert cut_at == len("The tower is in Paris. It was built in 1889. The tower is in Paris. ")


@pytest.mark.parametrize("text", [
    "Yes. Yes. Yes. ",  # shorter than MIN_REPEATED_WORDS: ordinary text
    "The tower is in Paris. It was built in 1889. The tower is in Paris, France. ",  # not word for word
    "The tower is in Paris. The tower is in Paris.",  # the last sentence may still go on ("Paris.5")
])
def test_ordinary_text_is_not_cut(text: str) -> None:
    assert repeated_sentence(text).cut is None
    assert MIN_REPEATED_WORDS == 4


def test_a_sentence_that_diverges_is_released_and_the_end_counts_as_a_boundary() -> None:
    assert repeated_sentence("The tower is in Paris. The tower is").safe == len("The tower is in Paris.")
    assert repeated_sentence("The tower is in Paris. The tower was").safe == len("The tower is in Paris. The tower was")
    done = repeated_sentence("The tower is in Paris. The tower is in Paris.", final=True)
    assert done == Repeat(len("The tower is in Paris."), len("The tower is in Paris."))


def test_repeated_list_lines_end_the_answer() -> None:
    text = "Steps:\n- open the valve slowly\n- close the drain\n- open the valve slowly\n"
    assert text[: repeated_sentence(text).cut] == "Steps:\n- open the valve slowly\n- close the drain"
