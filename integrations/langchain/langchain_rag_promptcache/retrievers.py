"""`PromptCacheRetriever`: a LangChain `BaseRetriever` over a corpus. Each `Document` carries the
chunk's text (for display, and for LLMs without the cache) and `metadata["module_id"]`, which
`format_modules` turns into a module reference; `metadata["source"]` is the document's name as the CLI
and the server show it, `metadata["section"]` the chunk's title and heading path in it ("" where it has
none) and `metadata["where"]` both, "file › section". `min_score` drops chunks scoring below it. Translation only."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from rag_promptcache.rag.retrieval import above


class PromptCacheRetriever(BaseRetriever):
    """`PromptCacheRetriever(corpus=Corpus.open(dir), k=4, min_score=None)`; `retriever.invoke(q, k=2)` per call."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    corpus: Any
    k: int = Field(default=4, gt=0)
    min_score: float | None = Field(default=None, ge=-1, le=1)

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None) -> list[Document]:
        hits = [self.corpus.hit(m, score) for m, score in above(self.corpus.search(query, self.k if k is None else k), self.min_score)]
        return [Document(page_content=self.corpus.text(h.module_id), id=h.module_id,
                         metadata={"module_id": h.module_id, "score": h.score, "source": h.label, "section": h.section,
                                   "where": h.where})
                for h in hits]
