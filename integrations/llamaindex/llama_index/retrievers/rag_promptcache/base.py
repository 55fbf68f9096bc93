"""`PromptCacheRetriever`: a LlamaIndex `BaseRetriever` over a corpus. Each `NodeWithScore` holds a
`TextNode` whose id is the module id (what `PromptCacheLLM` imports) and whose text is the chunk's;
`metadata["source"]` is the document's name as the CLI and the server show it, `metadata["section"]`
the chunk's title and heading path in it ("" where it has none) and `metadata["where"]` both, "file › section". `min_score` drops
chunks scoring below it (the query engine then answers "Not found in the documents." without
generating). Translation only."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from rag_promptcache.rag.retrieval import above


class PromptCacheRetriever(BaseRetriever):
    """`PromptCacheRetriever(corpus=Corpus.open(dir), similarity_top_k=4, min_score=None)`."""

    def __init__(self, corpus: Any, similarity_top_k: int = 4, min_score: float | None = None, **kwargs: Any) -> None:
        if similarity_top_k < 1:
            raise ValueError(f"similarity_top_k must be at least 1, got {similarity_top_k}")
        above([], min_score)  # checks its range
        self.corpus = corpus
        self.similarity_top_k = similarity_top_k
        self.min_score = min_score
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        hits = [self.corpus.hit(m, s) for m, s in above(self.corpus.search(query_bundle.query_str, self.similarity_top_k), self.min_score)]
        return [NodeWithScore(node=TextNode(id_=h.module_id, text=self.corpus.text(h.module_id),
                                            metadata={"source": h.label, "section": h.section, "where": h.where}), score=h.score)
                for h in hits]
