"""RAG on Prompt Cache: documents → chunks → prompt modules (KV stored once) + a FAISS index whose
ids are module ids; `Corpus.ask` imports the retrieved modules and computes only the question.

The names below are imported when first used: `Corpus` brings torch, transformers and the engine, and a
command that only checks a path or lists the loaders' file types (the CLI) must not wait for them.

Out of scope: KV computation and reuse (`rag_promptcache.engine`), storage tiers (`store`)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {
    "Chunk": "chunker", "Chunker": "chunker", "ChunkParams": "chunker",
    "DEFAULT_INSTRUCTIONS": "corpus", "DEFAULT_MODEL": "corpus", "Corpus": "corpus", "ModelMismatchError": "corpus",
    "is_corpus": "layout",
    "DEFAULT_EMBEDDER": "embed", "Embedder": "embed",
    "VectorIndex": "index", "faiss_id": "index",
    "Document": "loaders", "LoaderWarning": "loaders", "LoadReport": "loaders", "load": "loaders",
    "Answer": "records", "AnswerStream": "records", "IngestReport": "records", "Manifest": "records",
}

if TYPE_CHECKING:
    from rag_promptcache.rag.chunker import Chunk, Chunker, ChunkParams
    from rag_promptcache.rag.corpus import DEFAULT_INSTRUCTIONS, DEFAULT_MODEL, Corpus, ModelMismatchError
    from rag_promptcache.rag.embed import DEFAULT_EMBEDDER, Embedder
    from rag_promptcache.rag.index import KINDS as INDEX_KINDS
    from rag_promptcache.rag.index import VectorIndex, faiss_id
    from rag_promptcache.rag.layout import is_corpus
    from rag_promptcache.rag.loaders import Document, LoaderWarning, LoadReport, load
    from rag_promptcache.rag.records import Answer, AnswerStream, IngestReport, Manifest


def __getattr__(name: str) -> object:
    if name == "INDEX_KINDS":
        return importlib.import_module("rag_promptcache.rag.index").KINDS
    if name in _LAZY:
        return getattr(importlib.import_module(f"rag_promptcache.rag.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'rag_promptcache.rag' has no attribute {name!r}")


__all__ = [
    "DEFAULT_EMBEDDER", "DEFAULT_INSTRUCTIONS", "DEFAULT_MODEL", "INDEX_KINDS", "Answer", "AnswerStream", "Chunk",
    "ChunkParams", "Chunker", "Corpus", "Document", "Embedder", "IngestReport", "LoadReport", "LoaderWarning",
    "Manifest", "ModelMismatchError", "VectorIndex", "faiss_id", "is_corpus", "load",
]
