"""Sampling options and the choice of one token from next-token logits: temperature, top-k, top-p and
the repetition controls. Also which token ids end an answer (`eos_token_ids`). The output format
(`response_format`, constrained decoding) is an option here; its grammar is engine/decoding/grammar.py's.

Out of scope: the decode loop and what a request's answer so far is (engine/decoding/state.py), forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from rag_promptcache.engine.decoding.grammar import ResponseFormat

if TYPE_CHECKING:
    from transformers import PreTrainedModel


StopWhen = Callable[[str, bool], tuple[int | None, int]]
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling options. `stop` takes one string or a sequence of strings (as OpenAI, LangChain and
    LlamaIndex do) and is held as a tuple: a bare string is one stop string, never its characters."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Both look at the answer's own tokens only, never the prompt's: a RAG answer should copy its sources.
    repetition_penalty: float = 1.0  # > 1 divides a positive logit (multiplies a negative one) of each token already generated
    no_repeat_ngram: int = 0  # n > 0: no n-gram of the answer is generated twice (stops verbatim loops)
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks), as vLLM's ignore_eos
    # JSON output by constrained decoding: a ResponseFormat, or OpenAI's `response_format` dict
    # ({"type": "json_object"}, {"type": "json_schema", "json_schema": {...}}); None or {"type": "text"}: free text
    response_format: ResponseFormat | None = None
    # a stop condition on the answer's text, as a stop string is: (text so far, final) -> (where to end the
    # answer or None, how much may be streamed now); e.g. rag.repetition.repeated_sentence
    stop_when: StopWhen | None = None

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) for s in stop):
            raise ValueError(f"stop takes a string or a sequence of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)  # normalised once here: every caller gets a tuple
        if isinstance(self.response_format, dict):
            object.__setattr__(self, "response_format", ResponseFormat.from_openai(self.response_format))
        elif self.response_format is not None and not isinstance(self.response_format, ResponseFormat):
            raise ValueError("response_format takes a ResponseFormat, an OpenAI response_format dict or None, "
                             f"got {type(self.response_format).__name__}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (torch's generator), got {self.seed}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.repetition_penalty < 1.0:
            raise ValueError(f"repetition_penalty must be >= 1.0 (1.0 is off), got {self.repetition_penalty}")
        if self.no_repeat_ngram < 0 or self.no_repeat_ngram == 1:
            raise ValueError(f"no_repeat_ngram must be 0 (off) or >= 2, got {self.no_repeat_ngram}")


def penalize(logits: torch.Tensor, s: Sampling, generated: Sequence[int]) -> torch.Tensor:
    """logits: [V] fp32 → the same with the repetition controls applied to the answer so far."""
    if s.repetition_penalty != 1.0 and generated:
        seen = torch.tensor(sorted(set(generated)), device=logits.device)
        values = logits[seen]
        logits = logits.index_put((seen,), torch.where(values > 0, values / s.repetition_penalty, values * s.repetition_penalty))
    n = s.no_repeat_ngram
    if n and len(generated) >= n:
        prefix = tuple(generated[len(generated) - n + 1 :])
        banned = {generated[i + n - 1] for i in range(len(generated) - n + 1) if tuple(generated[i : i + n - 1]) == prefix}
        if banned:
            logits = logits.index_fill(0, torch.tensor(sorted(banned), device=logits.device), float("-inf"))
    return logits


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None, generated: Sequence[int] = ()) -> int:
    """logits: [V] fp32 → one token id. `generated`: the answer's tokens so far (for the repetition controls)."""
    logits = penalize(logits, s, generated)
    if s.temperature == 0:
        return int(logits.argmax())
    # shifted to a maximum of 0 before scaling, and the temperature no smaller than the dtype's smallest
    # normal number: a temperature near 0 then sends the rest to -inf (greedy), where dividing first
    # overflows to inf - inf = nan, and a temperature below fp32's range is a division by 0
    logits = (logits - logits.max()) / max(s.temperature, torch.finfo(logits.dtype).tiny)
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > s.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
