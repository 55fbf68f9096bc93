"""The engine's typed errors: what callers above (rag, server) tell apart without reading messages."""

from __future__ import annotations


class ContextWindowExceeded(ValueError):
    """A prompt plus the tokens asked for does not fit the model's context window.

    A `ValueError`, so code that catches bad input in general keeps working; the server maps it to a
    400 with OpenAI's `context_length_exceeded` code. `max_new_fits`: the most new tokens that would fit
    with this prompt (None: the prompt alone is too long), so a caller can name its own option."""

    def __init__(self, message: str, *, max_new_fits: int | None = None) -> None:
        super().__init__(message)
        self.max_new_fits = max_new_fits


class QuestionTooLong(ContextWindowExceeded):
    """The question, with the rest of the prompt, leaves too little of the model's context window for
    an answer: refused, where generating would give an empty or cut-off answer that says nothing of
    why. `num_question_tokens` and `window` are the numbers the message names."""

    def __init__(self, message: str, *, num_question_tokens: int, window: int) -> None:
        super().__init__(message, max_new_fits=None)
        self.num_question_tokens = num_question_tokens
        self.window = window
