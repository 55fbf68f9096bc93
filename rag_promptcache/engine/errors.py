"""The engine's typed errors: what callers above (rag, server) tell apart without reading messages."""

from __future__ import annotations


class ContextWindowExceeded(ValueError):
    """A prompt plus the tokens asked for does not fit the model's context window.

    A `ValueError`, so code that catches bad input in general keeps working; the server maps it to a
    400 with OpenAI's `context_length_exceeded` code."""
