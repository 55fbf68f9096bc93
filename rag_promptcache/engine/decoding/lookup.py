"""Prompt lookup decoding: draft the answer's next tokens from the text it is answering from.

A RAG answer copies its documents: names, numbers, whole phrases. When the answer's last few tokens
occurred before, in the prompt or in the answer itself, the tokens that followed them there are a
cheap guess at what comes next (Saxena's prompt lookup decoding; transformers' `prompt_lookup_num_tokens`,
vLLM's "ngram" speculative method). The model checks a guess of k tokens in one forward of k + 1
rows: on CPU a decode step is bound by reading the weights, so that forward costs little more than
one token's, and every accepted token is a step saved. Greedy only: the answer is the one plain
greedy decoding gives (up to float rounding, since k + 1 rows are summed in another order than one).

A check is not free: each drafted row adds its share of a forward's arithmetic (on this project's
2-core CPU with the native decode step, 9 rows cost about 2 one-row forwards at a 2k context). So how
many tokens to draft is chosen per forward (`DraftBudget`) from what the request's drafts have been
accepted at and a fixed cost per drafted row: where drafts are rarely kept, few or none are made.

This module is the bookkeeping: pure Python over token ids, no torch. The checks and the rollback
are the request's `DecodeState` (engine/decoding/state.py), whichever loop drives it: the engine's own
(engine/decoding/decode.py) or, for a request running alone in the server, the batcher's.

Out of scope: sampling with temperature (that needs rejection sampling against a draft
distribution), draft models, drafts for several rows at once (the server's batched step decodes one
token per row; engine/batching/batcher.py drafts only for a request running alone).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

DEFAULT_LOOKUP = 8  # tokens drafted per forward (PromptCache(prompt_lookup=...)); 0 is off
ENV = "RAG_PROMPTCACHE_PROMPT_LOOKUP"  # read when PromptCache(prompt_lookup=None), the default


def lookup_tokens(value: int | None) -> int:
    """`PromptCache(prompt_lookup=...)` → tokens drafted per forward. None reads RAG_PROMPTCACHE_PROMPT_LOOKUP
    (unset: DEFAULT_LOOKUP); 0 is off."""
    if value is None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return DEFAULT_LOOKUP
        if not raw.isdigit():
            raise ValueError(f"{ENV} must be an integer >= 0 (tokens drafted per forward; 0 is off), got {raw!r}")
        return int(raw)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"prompt_lookup must be an integer >= 0 (tokens drafted per forward; 0 is off), got {value!r}")
    return value


class NgramDrafter:
    """The token history (prompt, then answer) and, per n-gram, where it last ended.

    `draft(k)` matches the history's last `max_ngram`, then shorter, down to `min_ngram` tokens against
    an earlier occurrence (the latest one) and returns up to k tokens that followed it there."""

    def __init__(self, history: Iterable[int], *, min_ngram: int = 2, max_ngram: int = 4) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram=} {max_ngram=}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram → index of the token that followed it, latest
        self.extend(history)
        self.num_history = len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            # the n-grams ending at the current last token are followed by `token`: index them now,
            # so that a lookup never finds the history's own tail (it has no continuation yet)
            end = len(self.tokens)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._next[tuple(self.tokens[end - n :])] = end
            self.tokens.append(token)

    def draft_after(self, answer: Sequence[int], k: int) -> list[int]:
        """Index the tokens of `answer` (the whole answer so far) not seen yet, then `draft(k)`."""
        self.extend(answer[len(self.tokens) - self.num_history :])
        return self.draft(k)

    def draft(self, k: int) -> list[int]:
        """Up to `k` guessed next tokens; [] where the tail matches nothing earlier."""
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            start = self._next.get(tuple(self.tokens[end - n :]))
            if start is not None:
                return self.tokens[start : start + k]
        return []


class DraftBudget:
    """How many tokens to draft next: the number that makes the most tokens per unit of forward time.

    A check of d drafted tokens is one forward of d + 1 rows and yields 1 + a tokens, a being the
    drafted tokens kept before the first rejected one. If each is kept with probability p (given the
    ones before it were), E[1 + a] = (1 - p^(d+1)) / (1 - p), and the forward costs 1 + kappa d
    one-row forwards; `size()` picks the d in 0..max_tokens with the best ratio (0: draft nothing).
    p is estimated from this request's recent checks (counts decayed by DECAY per check, a Beta(1/2, 1/2)
    prior). kappa is a constant, not timed: the drafts, and so the answer's bf16 rounding, depend on
    the tokens alone, never on how busy the machine is (a timed kappa made answers vary between runs
    of the same computation). While the best d is 0,
    every PROBE-th forward still drafts one token, so a request that starts copying its documents
    again is noticed; that costs at most kappa / PROBE of a forward where nothing is kept.
    """

    KAPPA = 0.15  # a further row's share of a one-row forward: 0.10-0.14 measured at 2k with the native step
    DECAY = 0.9  # the last ~10 checks count
    PROBE = 4

    def __init__(self, max_tokens: int, kappa: float = KAPPA) -> None:
        self.max_tokens = max_tokens
        self.kappa = kappa
        self.kept = 0.0  # drafted tokens kept (decayed)
        self.trials = 0.0  # drafted tokens judged: the kept ones and the first rejected one (decayed)
        self._skipped = 0

    @property
    def p(self) -> float:
        return (self.kept + 0.5) / (self.trials + 1.0)

    def size(self) -> int:
        """Tokens to draft for the next forward (it may find fewer to draft)."""
        p, kappa = self.p, self.kappa
        best, best_rate = 0, 1.0
        for d in range(1, self.max_tokens + 1):
            rate = (1.0 - p ** (d + 1)) / (1.0 - p) / (1.0 + kappa * d)
            if rate > best_rate:
                best, best_rate = d, rate
        if best == 0 and self.max_tokens:
            self._skipped += 1
            if self._skipped >= self.PROBE:
                self._skipped = 0
                return 1
        return best

    def update(self, drafted: int, kept: int) -> None:
        """After a check of `drafted` tokens that kept `kept` of them."""
        if drafted:
            self.kept = self.DECAY * self.kept + kept
            self.trials = self.DECAY * self.trials + kept + (kept < drafted)
