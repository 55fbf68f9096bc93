"""rag-promptcache: Prompt Cache (modular attention reuse) for RAG on local Hugging Face models.

Each corpus chunk is a prompt module whose KV cache is computed once and stored; a prompt imports
modules, the engine assembles their KV at the right positions and computes only the new tokens.
"""

from rag_promptcache.pml.errors import PMLError

__version__ = "0.1.0"

_LAZY = {
    "PromptCache": "rag_promptcache.engine",
    "Result": "rag_promptcache.engine",
    "Comparison": "rag_promptcache.engine",
    "load_model": "rag_promptcache.model.loading",
    "Corpus": "rag_promptcache.rag",
    "ContextWindowExceeded": "rag_promptcache.engine.errors",
    "QuestionTooLong": "rag_promptcache.engine.errors",
}


def __getattr__(name: str):
    # torch, transformers and faiss are heavy: import them when first used, not on `import rag_promptcache`
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rag_promptcache' has no attribute {name!r}")


__all__ = ["PMLError", "PromptCache", "Result", "Comparison", "load_model", "Corpus", "ContextWindowExceeded",
           "QuestionTooLong", "__version__"]
