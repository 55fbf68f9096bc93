"""LangChain integration for rag-promptcache: `PromptCacheLLM`, `ChatPromptCache`, `PromptCacheRetriever`
and `format_modules`, so that an LCEL RAG chain imports retrieved modules' stored KV."""

try:
    import langchain_core  # noqa: F401
    import rag_promptcache.rag  # noqa: F401
except ImportError as e:
    raise ImportError(f"{e.name} is missing; install with: pip install langchain-rag-promptcache") from e

from langchain_rag_promptcache.chat_models import ChatPromptCache
from langchain_rag_promptcache.llms import PromptCacheLLM
from langchain_rag_promptcache.modules import format_modules
from langchain_rag_promptcache.retrievers import PromptCacheRetriever

__all__ = ["ChatPromptCache", "PromptCacheLLM", "PromptCacheRetriever", "format_modules"]
