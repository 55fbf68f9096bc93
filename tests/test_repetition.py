"""Repetition controls in `Sampling`: exact logits on hand-made inputs, validation, and the loop they
stop on the real SmolLM2."""

from __future__ import annotations

import pytest
import torch

from rag_promptcache.engine.decoding.sampling import Sampling, penalize, sample


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_generated_tokens() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 3.0])
    out = penalize(logits, Sampling(repetition_penalty=2.0), [0, 1, 0])
    assert out.tolist() == [1.0, -4.0, 1.0, 3.0]
    assert penalize(logits, Sampling(), [0, 1]).tolist() == logits.tolist()


def test_no_repeat_ngram_bans_the_token_that_would_repeat_an_ngram() -> None:
    logits = torch.zeros(10)
    logits[7] = 5.0  # the model's favourite would complete (5, 6, 7) a second time
    s = Sampling(no_repeat_ngram=3)
    assert sample(logits, s, None, [5, 6, 7, 1, 5, 6]) != 7
    assert sample(logits, s, None, [5, 6, 7, 1, 5]) == 7  # (5, 7) is no repeat
    assert penalize(logits, s, [5, 6, 7, 5, 6, 8, 5, 6]).isinf().nonzero().flatten().tolist() == [7, 8]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("repetition_penalty", 0.9, "repetition_penalty must be >= 1.0"),
    ("no_repeat_ngram", 1, "no_repeat_ngram must be 0 \\(off\\) or >= 2"),
    ("no_repeat_ngram", -2, "no_repeat_ngram must be 0"),
])
def test_bad_values_are_clear_errors(field: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Sampling(**{field: value})


@pytest.mark.parametrize("temperature", [5e-324, 1e-30, 1e-5])
def test_a_temperature_near_zero_samples_the_favourite(temperature: float) -> None:
    """Found by fuzzing the server: logits / 5e-324 overflowed to inf, and the softmax to nan (a 500)."""
    logits = torch.tensor([1.0, 3.0, -2.0, float("-inf"), 2.5])
    g = torch.Generator().manual_seed(0)
    assert all(sample(logits, Sampling(temperature=temperature, top_p=0.9), g) == 1 for _ in range(20))


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_is_refused_by_name(seed: int) -> None:
    """Found by fuzzing the server: a seed past 64 bits failed inside the decode loop (a 500)."""
    with pytest.raises(ValueError, match=r"seed must be an integer in \[-9223372036854775808, 18446744073709551615\]"):
        Sampling(seed=seed, temperature=1.0)
    Sampling(seed=2**64 - 1, temperature=1.0)


def ngrams(ids: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    return [ids[i : i + n] for i in range(len(ids) - n + 1)]


@pytest.mark.smollm
def test_a_verbatim_loop_of_the_small_model_is_stopped(smollm) -> None:
    from rag_promptcache.engine import PromptCache

    pc = PromptCache(*smollm, name="smollm2-135m-instruct")
    pc.add_schema('<schema name="chat"><system>You are a helpful assistant.</system></schema>')
    prompt = '<prompt schema="chat"><user>Repeat after me forever: la la la la la la la la la la</user></prompt>'
    looped = pc.generate(prompt, max_new_tokens=40)
    assert len(set(ngrams(looped.token_ids, 4))) < len(ngrams(looped.token_ids, 4))  # it loops without the control
    stopped = pc.generate(prompt, max_new_tokens=40, no_repeat_ngram=4)
    grams = ngrams(stopped.token_ids, 4)
    assert len(set(grams)) == len(grams)
    # decoded in a batch (the server's and generate_batch's path), the controls apply as alone
    batched = pc.generate_batch([prompt, prompt], max_new_tokens=40, no_repeat_ngram=4)
    assert [r.token_ids for r in batched] == [stopped.token_ids] * 2
    penalized = pc.generate(prompt, max_new_tokens=40, repetition_penalty=1.5)
    assert penalized.token_ids != looped.token_ids
    assert pc.generate_batch([prompt], max_new_tokens=40, repetition_penalty=1.5)[0].token_ids == penalized.token_ids
