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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rag_promptcache.rag.corpus import Corpus

SOURCE_PREFIX = "pydoc_data.topics/"  # every sample document's source starts with it

TOPICS = (
    "for", "while", "if", "else", "break", "continue", "pass", "try", "raise", "exceptions", "assert",
    "with", "context-managers", "function", "lambda", "return", "yield", "class", "import", "global",
    "nonlocal", "del", "async", "dict", "lists", "slicings", "truth", "booleans", "in",
)
# The demo's questions. Chosen for a 135M model: each answer is one sentence of one topic, which the model
# restates; open questions ("how do break and continue behave in a for loop?") drew 192 tokens of loops
# around a wrong example.
QUESTIONS = (
    "What does the return statement leave?",
    "What does the continue statement continue with?",
    "What happens when the condition of a while loop is false?",
)


@dataclass(frozen=True, slots=True)
class Expected:
    """What the reference says to a demo question: its topic, the sentence's words there, and the words a
    right answer states (tests/test_demo.py holds the first to the topic's text, the second to the model's
    answer)."""

    topic: str
    reference: str
    states: tuple[str, ...]


ANSWERS = {
    QUESTIONS[0]: Expected("return", "leaves the current function call with the expression list", ("current function call",)),
    QUESTIONS[1]: Expected("continue", "continues with the next cycle of the nearest enclosing loop",
                           ("next cycle of the nearest enclosing loop",)),
    QUESTIONS[2]: Expected("while", "the loop terminates", ("terminate",)),
}
# An answer is its first paragraph (the model's own blank line ends it), within DEMO_MAX_NEW_TOKENS: what
# follows a right first paragraph from this model is restatement that drifts from the text.
DEMO_STOP = ("\n\n",)
DEMO_MAX_NEW_TOKENS = 64
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
    return [SampleDocument(text, {"source": f"{SOURCE_PREFIX}{name}"}) for name, text in topic_texts(names).items()]


def sample_corpus(path: str | os.PathLike[str], topics: int | None = None, **build: object) -> Corpus:
    """The sample corpus at `path` (the first `topics` topics; None: all): built there, or, where one is
    already, opened and given the topics it lacks. A corpus holding any other document is refused with a
    ValueError: the examples and the demo never write into a user's own corpus."""
    from rag_promptcache.rag.corpus import Corpus
    from rag_promptcache.rag.layout import is_corpus

    if is_corpus(path):
        existing = Corpus.open(path)
        try:
            check_sample(existing)
        finally:
            existing.close()
    return Corpus.build(sample_documents()[:topics], path, **build)  # creates, or adds what is new


def check_sample(corpus: Corpus) -> None:
    """ValueError unless every document of `corpus` is a sample document (one the demo or an example added)."""
    foreign = [str(d["name"]) for d in corpus.documents() if not str(d["source"]).startswith(SOURCE_PREFIX)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise ValueError(f"{corpus.path} is a corpus with documents of its own ({shown}); the demo and the examples "
                         f"build and use their own sample corpus: pass a new directory with --corpus (default: {demo_home()})")


def demo_home() -> Path:
    """Where the demo corpus lives: `$RAG_PROMPTCACHE_HOME/demo-corpus` (default ~/.cache/rag-promptcache)."""
    return Path(os.environ.get("RAG_PROMPTCACHE_HOME") or Path.home() / ".cache" / "rag-promptcache") / "demo-corpus"
