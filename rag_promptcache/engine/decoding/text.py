"""`TextStream`: token ids in, text pieces out, holding back what could still become a stop string or
is an incomplete UTF-8 sequence.

Out of scope: when an answer ends for other reasons (EOS, length: engine/decoding/state.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Token ids in, text pieces out; stops at the first stop string, which is not emitted."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = (),
                 stop_when: Callable[[str, bool], tuple[int | None, int]] | None = None) -> None:
        """`stop_when(text, final) -> (cut, safe)`: another stop condition on the text (None: none): the
        answer ends at text[:cut] when cut is not None, and only text[:safe] may be emitted yet."""
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.stop_when = stop_when
        self.ids: list[int] = []
        self.text = ""  # text emitted so far
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        return self._emit(full, final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True), final=True)

    def _emit(self, full: str, final: bool) -> str:
        cut = min((i for i in (full.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if i >= 0),
                  default=-1)
        when_cut, when_safe = self.stop_when(full, final) if self.stop_when is not None else (None, len(full))
        if when_cut is not None:  # never before what was already emitted
            when_cut = max(when_cut, len(self.text))
            cut = when_cut if cut < 0 else min(cut, when_cut)
        if cut >= 0:
            self.stopped = True
            piece, self.text = full[len(self.text) : cut], full[:cut]
            return piece
        safe = len(full) if final else min(len(full), when_safe)
        if not final:
            for s in self.stop:  # hold back a tail that could still grow into a stop string
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        safe = min(safe, len(full) - k)
                        break
        safe = max(safe, len(self.text))
        piece, self.text = full[len(self.text) : safe], full[:safe]
        return piece
