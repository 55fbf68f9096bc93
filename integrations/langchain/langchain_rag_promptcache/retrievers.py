"""`PromptCacheRetriever`: a LangChain `BaseRetriever` over a corpus. Each `Document` carries the
chunk's text (for display, and for LLMs without the cache), its metadata (source, path, type, title,
modified, section and its document's own fields: `Corpus.metadata`) and `metadata["module_id"]`, which
`format_modules` turns into a module reference; `metadata["source"]` is the document's name as the CLI
and the server show it, `title` and `section` (the heading path under the title) as filters read them, and
`metadata["where"]` what sources show, "file › title › section". `min_score` drops chunks scoring below
it. `search_kwargs` takes what a vector store's retriever takes there: `k` and `filter` (LangChain's filter dict, applied inside the search:
rag/filters.py); any other key is refused by name. Translation only."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field, field_validator

from rag_promptcache.rag.retrieval import above

SEARCH_KWARGS = ("k", "filter")


class PromptCacheRetriever(BaseRetriever):
    """`PromptCacheRetriever(corpus=Corpus.open(dir), k=4, min_score=None, search_kwargs={"filter": {...}})`;
    `retriever.invoke(q, k=2, filter={...})` per call."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    corpus: Any
    k: int = Field(default=4, gt=0)
    min_score: float | None = Field(default=None, ge=-1, le=1)
    search_kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("search_kwargs")
    @classmethod
    def _known(cls, value: dict[str, Any]) -> dict[str, Any]:
        if unknown := sorted(set(value) - set(SEARCH_KWARGS)):
            raise ValueError(f"search_kwargs: unsupported key(s) {', '.join(unknown)}; valid: {', '.join(SEARCH_KWARGS)}")
        if "k" in value and (not isinstance(value["k"], int) or value["k"] < 1):
            raise ValueError(f"search_kwargs: k must be a positive integer, got {value['k']!r}")
        return value

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None, filter: dict[str, Any] | None = None) -> list[Document]:  # noqa: A002
        k = k if k is not None else self.search_kwargs.get("k", self.k)
        found = self.corpus.search(query, k, filter=filter if filter is not None else self.search_kwargs.get("filter"))
        hits = [self.corpus.hit(m, score) for m, score in above(found, self.min_score)]
        return [Document(page_content=self.corpus.text(h.module_id), id=h.module_id,
                         metadata={**self.corpus.metadata(h.module_id), "module_id": h.module_id, "score": h.score,
                                   "source": h.label, "where": h.where})
                for h in hits]
