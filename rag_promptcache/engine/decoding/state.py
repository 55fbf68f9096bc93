"""`DecodeState`: one request's answer as it is decoded, the same for the engine's loop and the batcher.

It owns everything about a request's decode that does not run the model: the token stream and its
text (`TextStream`, stop strings held back), the finish (EOS, stop string, token budget), the time to
first token, the sampling generator, and the prompt lookup drafter with its verify and rollback
(engine/decoding/lookup.py). Whoever runs forwards asks it what to feed (`next_input`) and hands it the logits
back (`advance`); it answers with the text pieces to emit and how many draft tokens to drop from the
cache. So the engine's single-request loop (engine/decoding/decode.py) and the batcher (engine/batching/batcher.py)
differ only in how they run the forward.

Every token is chosen in one place, `_choose`: the grammar of a constrained request (engine/decoding/grammar.py)
masks the logits there, once, for every path, and in an answer's last tokens takes the shortest way to
end the JSON when the budget would otherwise cut it (`GrammarState.closing`). A draft is checked row by
row through `_choose`, the grammar advancing with each kept token, so prompt lookup needs no grammar
rollback. A grammar that is complete ends the answer as an EOS would.

Out of scope: forwards and caches (engine/compute/runner.py, engine/decoding/decode.py, engine/batching/batch.py), sampling
math (engine/decoding/sampling.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from rag_promptcache.engine.decoding.grammar import GrammarState
from rag_promptcache.engine.decoding.lookup import DraftBudget, NgramDrafter
from rag_promptcache.engine.result import FinishReason
from rag_promptcache.engine.decoding.sampling import Sampling, penalize, sample
from rag_promptcache.engine.decoding.text import TextStream


@dataclass(slots=True)
class DecodeStats:
    """What one answer's decode ran: forwards after the prefill, and the prompt lookup drafts."""

    num_forwards: int = 0
    num_drafted: int = 0
    num_accepted: int = 0  # drafted tokens that were the model's own pick: each saved a forward


@dataclass(frozen=True, slots=True)
class Advance:
    """What one `advance` gave: text pieces to emit (the held-back tail included once finished), and the
    draft tokens whose KV the forward wrote but the answer rejected (drop them from the cache)."""

    pieces: list[str] = field(default_factory=list)
    num_rejected: int = 0


class DecodeState:
    def __init__(
        self,
        sampling: Sampling,
        *,
        start: int,
        eos_ids: frozenset[int],
        text: TextStream | None = None,
        history: Sequence[int] = (),
        lookup: int = 0,
        t0: float | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        """`start`: the position of the answer's first token. `text`: None decodes token ids only (no
        stop strings). `history`: the prompt's token ids, what prompt lookup drafts from; `lookup` > 0:
        draft up to that many tokens per forward (greedy only: ignored when sampling). `t0`: when the
        request came in, for the time to first token. `grammar`: the request's place in its
        `response_format` grammar (None: free text)."""
        self.sampling = sampling
        self.start = start
        self.eos_ids = frozenset() if sampling.ignore_eos else eos_ids
        self.text = text
        self.history = history
        self.lookup = lookup if sampling.temperature == 0 else 0
        self.t0 = time.perf_counter() if t0 is None else t0
        self.grammar = grammar
        self.tokens: list[int] = []  # the answer so far
        self.finish: FinishReason | None = None
        self.closed_by_budget = False  # the grammar's JSON was ended early so that the budget would not cut it
        self.ttft_s = 0.0
        self.stats = DecodeStats()
        self._generator: torch.Generator | None = None
        self._drafter: NgramDrafter | None = None  # built at the first draft, not before the first token
        self._budget = DraftBudget(self.lookup)  # how many tokens to draft, from what drafting has paid
        self._draft: list[int] = []  # fed with the last token, awaiting its check

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def position(self) -> int:
        """The position of the last token: the next one fed."""
        return self.start + len(self.tokens) - 1

    def next_input(self, *, draft: bool = True) -> list[int]:
        """The tokens the next forward runs, from `position` on: the last token and, where prompt lookup
        is on and `draft`, up to `lookup` tokens guessed to follow it. Counts the forward."""
        assert self.tokens and not self.finished, f"{len(self.tokens)=} {self.finish=}"
        self._draft = []
        if draft and self.lookup:
            self._drafter = self._drafter or NgramDrafter(self.history)
            budget = min(self._budget.size(), self.sampling.max_new_tokens - len(self.tokens) - 1)
            self._draft = self._drafter.draft_after(self.tokens, budget) if budget > 0 else []
        self.stats.num_forwards += 1
        self.stats.num_drafted += len(self._draft)
        return [self.tokens[-1], *self._draft]

    def advance(self, rows: torch.Tensor) -> Advance:
        """rows: [1 + len(draft), V] fp32, row j the logits after the input's first j + 1 tokens (the
        prefill's: one row) → the tokens chosen, each emitted while it is the draft's own next token."""
        draft, self._draft = self._draft, []
        out = Advance()
        for j in range(rows.shape[0]):
            token = self._choose(rows[j])
            kept = j < len(draft) and token == draft[j]
            self.stats.num_accepted += kept
            piece = self._accept(token)
            if piece:
                out.pieces.append(piece)
            if self.finished:
                tail = self.text.finish() if self.text is not None else ""
                if tail:
                    out.pieces.append(tail)
                return out  # the cache is done with: nothing to roll back
            if not kept:
                self._budget.update(len(draft), j)
                return Advance(out.pieces, len(draft) - j)
        return out

    def _choose(self, logits: torch.Tensor) -> int:
        """logits [V] fp32 → the next token, given the answer so far."""
        s = self.sampling
        if self._generator is None and s.seed is not None and s.temperature > 0:
            self._generator = torch.Generator(device=logits.device).manual_seed(s.seed)
        if self.grammar is not None:
            # the budget is about to run out: end the JSON now rather than be cut inside it
            if (closing := self.grammar.closing(s.max_new_tokens - len(self.tokens))) is not None:
                self.closed_by_budget = True
                return closing
            logits = self.grammar.mask(logits)
            # JSON repeats its structure (`}, {"name": `); where every continuation the grammar allows
            # repeats an n-gram, the grammar wins over no_repeat_ngram
            if s.no_repeat_ngram and not torch.isfinite(penalize(logits, s, self.tokens)).any():
                s = replace(s, no_repeat_ngram=0)
        return sample(logits, s, self._generator, self.tokens)

    def _accept(self, token: int) -> str:
        """Append `token` → its text piece; sets `finish` when it ends the answer."""
        if not self.tokens:
            self.ttft_s = time.perf_counter() - self.t0
        self.tokens.append(token)
        if self.grammar is not None:
            self.grammar.accept(token)
        if token in self.eos_ids:  # never emitted as text
            self.finish = "eos"
            return ""
        piece = self.text.push(token) if self.text is not None else ""
        if self.text is not None and self.text.stopped:
            self.finish = "stop"
        elif self.grammar is not None and self.grammar.is_terminated():
            # the JSON is complete: nothing but an EOS could follow; closed for the budget, the budget ended it
            self.finish = "length" if self.closed_by_budget else "eos"
        elif len(self.tokens) >= self.sampling.max_new_tokens:
            self.finish = "length"
        return piece
