"""Chat turns over a corpus → the prompt to generate from, with its sources: what a server needs per request.

The last turn is the question; earlier turns are history. Retrieval is `Corpus.retrieve_turns` (each
user turn's search fitted to the context window, once per conversation turn), as in `Corpus.ask`; the prompt is `rag.prompts.build_prompt`, so modules are
imported (their stored KV reused) exactly as the framework adapters import them. `module_ids`
skips retrieval. A follow-up that retrieves the same modules as the turn before imports them in that
turn's order (`keep_order`), so the engine's prefix cache reuses the earlier turn. `completion_prompt`
is the raw-prompt counterpart (PML or plain text).

Not here: generation (the engine's scheduler) and any HTTP types (server/).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_promptcache.pml import ast
from rag_promptcache.rag.prompts import ANSWER_DEFAULTS, build_prompt
from rag_promptcache.rag.retrieval import Hit

if TYPE_CHECKING:
    from rag_promptcache.rag.corpus import Corpus

ROLES = ("system", "user", "assistant")


Source = Hit  # a response's source: module id, label, score (rounded; None when named by the caller), section, snippet


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    prompt: str | ast.Prompt | None  # what `PromptCache.generate` / `Batcher.submit` take; None: nothing found
    sources: tuple[Source, ...]

    @property
    def not_found(self) -> bool:
        """No chunk scored the request's `min_score`: answer `retrieval.NOT_FOUND` without generating."""
        return self.prompt is None


class CorpusChat:
    """One corpus shared by concurrent requests: retrieval and prompt building run under one lock
    (the chunk table is one SQLite connection), generation does not."""

    def __init__(self, corpus: Corpus) -> None:
        self.corpus = corpus
        self._lock = threading.Lock()
        with self._lock:
            corpus.prepare()

    def chat_prompt(
        self,
        turns: Sequence[tuple[str, str]],
        *,
        k: int = 4,
        module_ids: Sequence[str] | None = None,
        max_new_tokens: int = ANSWER_DEFAULTS.max_new_tokens,
        min_score: float | None = None,
        filter: Mapping[str, object] | None = None,  # noqa: A002 - LangChain's name, the request field's
    ) -> ChatPrompt:
        """The prompt for the last user turn with its sources. With `min_score` and no chunk scoring it
        (cosine), `ChatPrompt.not_found`; so with `filter` (`Corpus.search`) and no chunk matching it.
        `module_ids` skip retrieval and `min_score`, and cannot come with a filter."""
        if not turns:
            raise ValueError("no messages: send at least one user message")
        for role, _ in turns:
            if role not in ROLES:
                raise ValueError(f"unsupported message role {role!r}; valid: {', '.join(ROLES)}")
        if turns[-1][0] != "user":
            raise ValueError(f"the last message must be the user's question, got a {turns[-1][0]!r} message")
        c = self.corpus
        try:
            flt = c.catalog.check(filter)
        except ValueError as e:
            raise ValueError(f"filter: {e}") from e
        if flt is not None and module_ids is not None:
            raise ValueError("filter: module_ids name the modules and skip retrieval, which a filter narrows; send one of them")
        with self._lock:
            if module_ids is None:
                found = c.retrieve_turns(turns, k, max_new_tokens=max_new_tokens, min_score=min_score, filter=flt)
                if not found.hits:
                    return ChatPrompt(None, ())
                hits = [dataclasses.replace(h, score=round(float(h.score), 4)) for h in found.hits]
                order = list(found.order)
            else:
                unknown = [m for m in module_ids if not c.has_module(m)]
                if unknown:
                    raise ValueError(f"unknown module id(s) {unknown} in corpus {c.path.name}; "
                                     "module ids come from a response's sources")
                hits = [c.hit(m) for m in dict.fromkeys(module_ids)]
                order = [h.module_id for h in hits]
            prompt = build_prompt(turns, corpus=c, module_ids=order)
        return ChatPrompt(prompt, tuple(hits))

    def completion_prompt(self, text: str) -> ChatPrompt:
        """A raw prompt: PML (which may import the corpus's modules by name) or plain text, as is."""
        if not text.strip():
            raise ValueError("the prompt is empty")
        with self._lock:
            prompt = build_prompt([("user", text)], corpus=self.corpus, chat=False)
        return ChatPrompt(prompt, ())
