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
