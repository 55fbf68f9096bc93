"""A corpus as plain LlamaIndex parts, for the stock `VectorStoreIndex` flow:

    Settings.llm, Settings.embed_model = PromptCacheLLM(corpus=c), PromptCacheEmbedding(corpus=c)
    index = VectorStoreIndex(corpus_nodes(c))

`corpus_nodes` makes one `TextNode` per module (id = module id). What a node shows an LLM is a
module reference, `<module id="m…">text</module>`: any LLM reads the text, and `PromptCacheLLM`
imports the module's stored KV instead, so the stock synthesizers reuse KV. Embeddings see the bare
text. `PromptCacheEmbedding` embeds with the corpus's own embedder. Translation only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.schema import TextNode
from pydantic import ConfigDict

MODULE_KEY = "module_id"
REFERENCE_TEMPLATE = '<module id="{metadata_str}">{content}</module>'


def corpus_nodes(corpus: Any, module_ids: Sequence[str] | None = None) -> list[TextNode]:
    """Nodes for the corpus's modules (all, or the given ids), with their vectors attached so that
    indexing them embeds nothing again."""
    ids = [m for m, _ in corpus.table.modules()] if module_ids is None else list(module_ids)
    faiss_ids, vectors = corpus.table.vectors(corpus.manifest.dim)
    by_faiss = dict(zip(faiss_ids.tolist(), vectors))
    from rag_promptcache.rag import faiss_id

    hits = [corpus.hit(m) for m in ids]
    shown = ["source", "section", "where"]  # the names the CLI and server show, not for the LLM or the embedder
    return [
        TextNode(
            id_=h.module_id, text=corpus.text(h.module_id), embedding=by_faiss[faiss_id(h.module_id)].tolist(),
            metadata={MODULE_KEY: h.module_id, "source": h.label, "section": h.section, "where": h.where},
            excluded_llm_metadata_keys=shown, excluded_embed_metadata_keys=[MODULE_KEY, *shown],
            metadata_template="{value}", text_template=REFERENCE_TEMPLATE,
        )
        for h in hits
    ]


class PromptCacheEmbedding(BaseEmbedding):
    """The corpus's embedder as a LlamaIndex embedding model (queries and texts alike)."""

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")
    corpus: Any = None

    def __init__(self, corpus: Any, **kwargs: Any) -> None:
        super().__init__(corpus=corpus, model_name=corpus.manifest.embedder, **kwargs)

    @classmethod
    def class_name(cls) -> str:
        return "PromptCacheEmbedding"

    def _get_query_embedding(self, query: str) -> list[float]:
        return self.corpus.embedder.embed([query])[0].tolist()

    def _get_text_embedding(self, text: str) -> list[float]:
        return self.corpus.embedder.embed([text])[0].tolist()

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self.corpus.embedder.embed(texts).tolist()

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)
