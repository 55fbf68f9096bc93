"""`PromptCacheRetriever`: a LlamaIndex `BaseRetriever` over a corpus. Each `NodeWithScore` holds a
`TextNode` whose id is the module id (what `PromptCacheLLM` imports) and whose text is the chunk's.
Translation only."""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode


class PromptCacheRetriever(BaseRetriever):
    """`PromptCacheRetriever(corpus=Corpus.open(dir), similarity_top_k=4)`."""

    def __init__(self, corpus: Any, similarity_top_k: int = 4, **kwargs: Any) -> None:
        if similarity_top_k < 1:
            raise ValueError(f"similarity_top_k must be at least 1, got {similarity_top_k}")
        self.corpus = corpus
        self.similarity_top_k = similarity_top_k
        super().__init__(**kwargs)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return [
            NodeWithScore(node=TextNode(id_=m, text=self.corpus.text(m), metadata={"source": self.corpus.source(m)}), score=score)
            for m, score in self.corpus.search(query_bundle.query_str, self.similarity_top_k)
        ]
