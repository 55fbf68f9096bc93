"""The built-in sample corpus: part of the Python language reference that ships inside CPython
(`pydoc_data.topics`), so the demo, the examples and the benchmark need no download.

The topic list is chosen for the demo's budget: about 62k characters (~15k tokens, ~70 modules of
at most 256 tokens), which encodes in about a minute on two CPU cores.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

TOPICS = (
    "for", "while", "if", "else", "break", "continue", "pass", "try", "raise", "exceptions", "assert",
    "with", "context-managers", "function", "lambda", "return", "yield", "class", "import", "global",
    "nonlocal", "del", "async", "dict", "lists", "slicings", "truth", "booleans", "in",
)
QUESTIONS = (
    "What does the yield statement do inside a function?",
    "How do break and continue behave inside a for loop?",
    "What happens when an exception is raised inside a try statement with an except clause?",
)
WARM_UP = "What does the pass statement do?"  # the demo's untimed first request, not one of QUESTIONS


@dataclass(frozen=True, slots=True)
class SampleDocument:
    """Shaped like a LangChain Document, which the loaders accept."""

    page_content: str
    metadata: dict[str, str] = field(default_factory=dict)


def topic_texts(names: Sequence[str] | None = None) -> dict[str, str]:
    """Topics by name (all of them, sorted, when `names` is None)."""
    from pydoc_data.topics import topics

    return {n: topics[n] for n in (sorted(topics) if names is None else names) if n in topics}


def sample_documents(names: Sequence[str] = TOPICS) -> list[SampleDocument]:
    return [SampleDocument(text, {"source": f"pydoc_data.topics/{name}"}) for name, text in topic_texts(names).items()]


def demo_home() -> Path:
    """Where the demo corpus lives: `$RAG_PROMPTCACHE_HOME/demo-corpus` (default ~/.cache/rag-promptcache)."""
    return Path(os.environ.get("RAG_PROMPTCACHE_HOME") or Path.home() / ".cache" / "rag-promptcache") / "demo-corpus"
