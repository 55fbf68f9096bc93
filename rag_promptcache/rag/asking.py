"""`Answering`: the corpus's retrieval and answers (`search`, `retrieve`, `retrieve_turns`, `prompt`,
`order`, `ask`), a part of `Corpus` kept in its own file. It reads the corpus's index, table,
embedder, engine and manifest; opening, building and ingesting stay in `corpus.py`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rag_promptcache.engine.result import fixed_stream
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.rag import retrieval
from rag_promptcache.rag.filters import Filter
from rag_promptcache.rag.index import faiss_id
from rag_promptcache.rag.lazy import RetrievalLog
from rag_promptcache.rag.metadata import Catalog
from rag_promptcache.rag.records import Answer, AnswerStream, Manifest
from rag_promptcache.rag.repetition import ANSWER_DEFAULTS, answer_options
from rag_promptcache.rag.retrieval import Conversations, Hit, Retrieved

if TYPE_CHECKING:
    from rag_promptcache.rag.embed import EmbedderLike
    from rag_promptcache.rag.engine_slot import EngineSlot
    from rag_promptcache.rag.index import VectorIndex
    from rag_promptcache.rag.lexical import LexicalIndex
    from rag_promptcache.rag.table import ChunkTable


class Answering:
    """Mixed into `Corpus`, which sets these and defines `prepare` and `label`."""

    path: Path
    manifest: Manifest
    index: VectorIndex
    lexical: LexicalIndex
    table: ChunkTable
    embedder: EmbedderLike
    lock: threading.RLock
    conversations: Conversations
    retrievals: RetrievalLog
    engine_slot: EngineSlot  # the corpus's engine, loaded on first use

    @functools.cached_property
    def catalog(self) -> Catalog:
        """The chunks' metadata, and which modules a filter matches (`metadata.py`)."""
        return Catalog(self.table)

    def search(self, question: str, k: int = 4, mode: str = "hybrid", *,
               filter: Filter | Mapping[str, object] | None = None) -> list[tuple[str, float]]:  # noqa: A002 - LangChain's name
        """The k modules that best answer the question: (module id, cosine score), best first. No text.
        `mode`: "hybrid" (dense and BM25 rankings fused, the default), "dense" or "lexical" (`retrieval.MODES`).
        `filter` (`filters.py`: `{"source": "guide.md"}`, `{"year": {"$gte": 2020}}`, ...): only modules with
        a matching chunk, chosen inside the search (k come back whenever k match); a key no chunk carries
        is a `ValueError` naming the valid ones."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not len(self.index):
            raise ValueError(f"corpus {self.path} is empty; add documents with: rag-promptcache ingest PATH --corpus {self.path}")
        if not question.strip():
            raise ValueError("the question is empty")
        allowed = self.catalog.matching(filter)
        return retrieval.search(self.index, self.lexical, self.lock, self.embedder, self.table, question, k, mode, allowed)

    def retrieve(self, question: str, k: int = 4, *, history: Sequence[tuple[str, str]] = (),
                 max_new_tokens: int = ANSWER_DEFAULTS.max_new_tokens, min_score: float | None = None,
                 filter: Filter | Mapping[str, object] | None = None) -> list[Hit]:  # noqa: A002
        """`search` (within `filter`), less the hits scoring below `min_score`, then the lowest-scoring hits dropped until
        the prompt (instructions, modules, `history`, question) and `max_new_tokens` fit the model's
        context window: what `ask` imports. `ContextWindowExceeded` when not even the best hit fits;
        empty when none scores `min_score`."""
        found = retrieval.above(self.search(question, k, filter=filter), min_score)
        if not found:
            return []
        engine = self.engine_slot.get()
        hits = retrieval.fit(
            found, [self.table.module(m)[1] for m, _ in found], lambda t: len(engine.tokenizer.encode(t, add_special_tokens=False)),
            instructions=self.manifest.instructions, question=question, history=history, max_new=max_new_tokens,
            window=getattr(engine, "context_window", 0) or 1 << 30)
        self.retrievals.note(m for m, _ in hits)  # what `warm` encodes first (rag/lazy.py)
        return [self.hit(m, s) for m, s in hits]

    def retrieve_turns(self, turns: Sequence[tuple[str, str]], k: int = 4, *,
                       max_new_tokens: int = ANSWER_DEFAULTS.max_new_tokens, min_score: float | None = None, filter: Filter | Mapping[str, object] | None = None) -> Retrieved:  # noqa: A002
        """A conversation's retrieval: `turns` (role, text), the last one the user's question → its hits
        (`retrieve`, every earlier turn's text counted against the window; those scoring below `min_score`
        dropped, none left when none scores it) and the order to import them in, which follows earlier
        user turns' retrievals (`keep_order`: a follow-up's prompt then starts with the previous one's).
        Earlier turns' retrievals are remembered, so each turn searches once; what `ask` with history and
        `CorpusChat` both use. `filter`: every turn's search is within it (`search`)."""
        flt = self.catalog.check(filter)  # a bad filter is refused before anything is searched
        with self.lock:
            return self.conversations.retrieve(
                turns, k, max_new_tokens,
                lambda q, history: self.retrieve(q, k, history=history, max_new_tokens=max_new_tokens, filter=flt),
                min_score, "" if flt is None else str(flt))

    def metadata(self, module_id: str) -> dict[str, object]:
        """The chunk's metadata, what filters read (`metadata.py`): source, path, type, title, modified,
        section and its document's own fields."""
        found = self.catalog.of(faiss_id(module_id))
        if not found:
            raise ValueError(f"no module {module_id!r} in corpus {self.path}")
        return found

    def hit(self, module_id: str, score: float | None = None) -> Hit:
        """A module as answers show it: its document's label, section and snippet (`retrieval.Hit`), the
        one place they are filled for every path (ask, chat, the server, the adapters)."""
        label = self.label(module_id)
        return Hit(module_id, label, score, retrieval.section_of(self.table.context(module_id), label),
                   retrieval.snippet(self.text(module_id)))

    def label(self, module_id: str) -> str:
        """The name of the document a module came from, as `documents()` and answers' sources show it."""
        source = self.source(module_id)
        doc = self.table.document(source)
        return doc.shown if doc else source

    def text(self, module_id: str) -> str:
        """The chunk's text (without the source label the module carries)."""
        found = self.table.module(module_id)
        if found is None:
            raise ValueError(f"no module {module_id!r} in corpus {self.path}")
        text = found[0]
        return text.split("\n", 1)[1].strip() if text.startswith("[") and "\n" in text else text.strip()

    def source(self, module_id: str) -> str:
        """The document a module came from (the first, when identical chunks came from several)."""
        rows = self.table.sources(module_id)
        if not rows:
            raise ValueError(f"no module {module_id!r} in corpus {self.path}")
        return rows[0][0]

    def has_module(self, module_id: str) -> bool:
        return self.table.has_module(module_id)

    def prompt(self, question: str, module_ids: Sequence[str], history: Sequence[tuple[str, str]] = ()) -> str:
        """The PML prompt: retrieved modules in order, earlier turns, then the question."""
        turns = [t for u, a in history for t in (("user", u), ("assistant", a))]
        return prompt_pml(self.manifest.name, module_ids, [*turns, ("user", question)])

    def order(self, module_ids: Sequence[str]) -> list[str]:
        """Retrieved modules (best first) in the order the prompt imports them: best last, next to
        the question, where recovery `last:N` recomputes it (docs/FIDELITY.md)."""
        return list(module_ids)[::-1]

    def ask(self, question: str, k: int = 4, *, history: Sequence[tuple[str, str]] = (), stream: bool = False,
            max_new_tokens: int = ANSWER_DEFAULTS.max_new_tokens, min_score: float | None = None,
            filter: Filter | Mapping[str, object] | None = None,  # noqa: A002
            **sampling: object) -> Answer | AnswerStream:
        """Retrieve, import the modules' cached KV, and generate. `stream=True` returns an
        `AnswerStream` (iterate for text; `.answer` when done). With `min_score`, a question no chunk
        scores at least that for (cosine) is answered `retrieval.NOT_FOUND` without generating
        (`Answer.path` "none"); so is a question no chunk within `filter` (`search`) answers. `sampling`: the engine's (temperature,
        stop, recovery, repetition_penalty, ...); no_repeat_ngram defaults to DEFAULT_NO_REPEAT_NGRAM, and the
        answer ends at a repeated sentence unless `stop_repeats=False`."""
        sampling = answer_options(sampling)
        if sampling.get("recovery") is None and self.manifest.recovery is not None:
            sampling["recovery"] = self.manifest.recovery  # the corpus's (eval --apply), also with a caller's engine
        # a follow-up over the same modules keeps the earlier turns' import order: its prompt then
        # starts with the previous turn's, which the engine's prefix cache reuses (retrieval.keep_order)
        turns = [t for u, a in history for t in (("user", u), ("assistant", a))]
        found = self.retrieve_turns([*turns, ("user", question)], k, max_new_tokens=max_new_tokens, min_score=min_score,
                                    filter=filter)
        hits = found.hits
        if not hits:
            out = AnswerStream(fixed_stream(retrieval.NOT_FOUND), (), "")
            return out if stream else out.consume()
        prompt = self.prompt(question, self.order(found.order), history)
        engine = self.prepare()
        out = AnswerStream(engine.stream(prompt, max_new_tokens=max_new_tokens, **sampling), hits, prompt)
        return out if stream else out.consume()

    def ask_stream(self, question: str, k: int = 4, **kwargs: object) -> AnswerStream:
        out = self.ask(question, k, stream=True, **kwargs)
        assert isinstance(out, AnswerStream)
        return out
