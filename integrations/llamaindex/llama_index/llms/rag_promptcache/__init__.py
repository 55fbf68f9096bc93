"""LlamaIndex integration for rag-promptcache: `PromptCacheLLM` (module ids as a keyword), and
`PromptCacheQueryEngine`, a `RetrieverQueryEngine` whose synthesizer hands module ids to the LLM."""

try:
    import llama_index.core  # noqa: F401
    import rag_promptcache.rag  # noqa: F401
except ImportError as e:
    raise ImportError(f"{e.name} is missing; install with: pip install llama-index-rag-promptcache") from e

from llama_index.llms.rag_promptcache.base import PromptCacheLLM
from llama_index.llms.rag_promptcache.query_engine import ModuleSynthesizer, PromptCacheQueryEngine

__all__ = ["ModuleSynthesizer", "PromptCacheLLM", "PromptCacheQueryEngine"]
