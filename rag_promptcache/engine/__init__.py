"""The engine: compile PML, plan hits and misses, assemble relocated module KV, prefill, decode."""

from rag_promptcache.engine.decode import Sampling
from rag_promptcache.engine.encoder import DEFAULT_MODE, MODES
from rag_promptcache.engine.engine import PLAIN, Plan, PromptCache
from rag_promptcache.engine.errors import ContextWindowExceeded
from rag_promptcache.engine.result import AsyncStream, Comparison, EncodeReport, Result, Stream

__all__ = ["ContextWindowExceeded", "DEFAULT_MODE", "MODES", "PLAIN", "AsyncStream", "Comparison", "EncodeReport", "Plan", "PromptCache", "Result", "Sampling", "Stream"]
