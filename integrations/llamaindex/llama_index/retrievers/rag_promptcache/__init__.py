"""LlamaIndex retriever over a rag-promptcache corpus: nodes whose id is the module id."""

try:
    import llama_index.core  # noqa: F401
    import rag_promptcache.rag  # noqa: F401
except ImportError as e:
    raise ImportError(f"{e.name} is missing; install with: pip install llama-index-rag-promptcache") from e

from llama_index.retrievers.rag_promptcache.base import PromptCacheRetriever
from llama_index.retrievers.rag_promptcache.nodes import PromptCacheEmbedding, corpus_nodes

__all__ = ["PromptCacheEmbedding", "PromptCacheRetriever", "corpus_nodes"]
