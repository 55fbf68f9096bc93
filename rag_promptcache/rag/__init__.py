"""RAG on Prompt Cache: documents → chunks → prompt modules (KV stored once) + a FAISS index whose
ids are module ids; `Corpus.ask` imports the retrieved modules and computes only the question.

Out of scope: KV computation and reuse (`rag_promptcache.engine`), storage tiers (`store`)."""

from rag_promptcache.rag.chunker import Chunk, Chunker, ChunkParams
from rag_promptcache.rag.corpus import DEFAULT_INSTRUCTIONS, DEFAULT_MODEL, Corpus, ModelMismatchError, is_corpus
from rag_promptcache.rag.embed import DEFAULT_EMBEDDER, Embedder
from rag_promptcache.rag.index import KINDS as INDEX_KINDS
from rag_promptcache.rag.index import VectorIndex, faiss_id
from rag_promptcache.rag.loaders import Document, LoaderWarning, LoadReport, load
from rag_promptcache.rag.records import Answer, AnswerStream, IngestReport, Manifest

__all__ = [
    "DEFAULT_EMBEDDER", "DEFAULT_INSTRUCTIONS", "DEFAULT_MODEL", "INDEX_KINDS", "Answer", "AnswerStream", "Chunk",
    "ChunkParams", "Chunker", "Corpus", "Document", "Embedder", "IngestReport", "LoadReport", "LoaderWarning",
    "Manifest", "ModelMismatchError", "VectorIndex", "faiss_id", "is_corpus", "load",
]
