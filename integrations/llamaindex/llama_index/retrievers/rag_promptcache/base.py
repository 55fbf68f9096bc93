"""`PromptCacheRetriever`: a LlamaIndex `BaseRetriever` over a corpus. Each `NodeWithScore` holds a
`TextNode` whose id is the module id (what `PromptCacheLLM` imports) and whose text is the chunk's;
its metadata is the chunk's (`Corpus.metadata`: source, path, type, title, modified, section and its
document's own fields; `title` and `section`, the heading path under the title, as filters read them),
`metadata["source"]` the document's name as the CLI and the server show it, `metadata["where"]` what
sources show, "file › title › section".
`min_score` drops chunks scoring below it (the query engine then answers "Not found in the documents."
without generating). `filters` (LlamaIndex's `MetadataFilters`) become the core's filter (`to_filter`),
applied inside the search; an operator or condition it has no counterpart for is refused by name.
Translation only."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.core.vector_stores.types import MetadataFilters
from rag_promptcache.rag.retrieval import above

# LlamaIndex's FilterOperator values -> the core's (rag/filters.py): `any` (a list field holds one of the
# values) is `$in` there and `contains` (a list field holds the value) is `$eq`, both of which match a
# list field by its items
OPERATORS = {"==": "$eq", "!=": "$ne", ">": "$gt", ">=": "$gte", "<": "$lt", "<=": "$lte", "in": "$in", "nin": "$nin",
             "any": "$in", "contains": "$eq"}
CONDITIONS = {"and": "$and", "or": "$or"}


def to_filter(filters: MetadataFilters | None) -> dict[str, object] | None:
    """LlamaIndex's `MetadataFilters` as the core's filter dict (None: no filter). `ValueError` naming an
    operator or a condition without a counterpart, and the valid ones."""
    if filters is None:
        return None
    condition = getattr(filters.condition, "value", filters.condition) or "and"
    if condition not in CONDITIONS:
        raise ValueError(f"MetadataFilters condition {condition!r} is not supported; valid: {', '.join(CONDITIONS)}")
    parts: list[dict[str, object]] = []
    for f in filters.filters:
        if isinstance(f, MetadataFilters):
            if (inner := to_filter(f)) is not None:
                parts.append(inner)
            continue
        op = getattr(f.operator, "value", f.operator)
        if op not in OPERATORS:
            raise ValueError(f"filter operator {op!r} on key {f.key!r} is not supported; valid: {', '.join(OPERATORS)}")
        parts.append({f.key: {OPERATORS[op]: f.value}})
    return {CONDITIONS[condition]: parts} if parts else None


class PromptCacheRetriever(BaseRetriever):
    """`PromptCacheRetriever(corpus=Corpus.open(dir), similarity_top_k=4, min_score=None, filters=None)`."""

    def __init__(self, corpus: Any, similarity_top_k: int = 4, min_score: float | None = None,
                 filters: MetadataFilters | None = None, **kwargs: Any) -> None:
        if similarity_top_k < 1:
            raise ValueError(f"similarity_top_k must be at least 1, got {similarity_top_k}")
        above([], min_score)  # checks its range
        self.corpus = corpus
        self.similarity_top_k = similarity_top_k
        self.min_score = min_score
        self.filters = filters
        self._filter = corpus.catalog.check(to_filter(filters))  # a bad filter is refused now, not at the first query
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        found = self.corpus.search(query_bundle.query_str, self.similarity_top_k, filter=self._filter)
        hits = [self.corpus.hit(m, score) for m, score in above(found, self.min_score)]
        return [NodeWithScore(node=TextNode(id_=h.module_id, text=self.corpus.text(h.module_id),
                                            metadata={**self.corpus.metadata(h.module_id), "source": h.label,
                                                      "where": h.where}), score=h.score)
                for h in hits]
