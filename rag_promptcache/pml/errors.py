"""The one error type of the schema language."""

from __future__ import annotations


class PMLError(ValueError):
    """Malformed or invalid PML. Carries where (1-based line and column) and what."""

    def __init__(self, message: str, line: int, column: int) -> None:
        super().__init__(f"line {line}, column {column}: {message}")
        self.message = message
        self.line = line
        self.column = column
