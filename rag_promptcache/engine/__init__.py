"""The engine: compile PML, plan hits and misses, assemble relocated module KV, prefill, decode."""

from rag_promptcache.engine.planning.encoder import DEFAULT_MODE, MODES
from rag_promptcache.engine.engine import PromptCache
from rag_promptcache.engine.errors import ContextWindowExceeded, QuestionTooLong
from rag_promptcache.engine.planning.plan import Plan
from rag_promptcache.engine.result import AsyncStream, Comparison, EncodeReport, Result, Stream
from rag_promptcache.engine.decoding.sampling import Sampling
from rag_promptcache.engine.prompt.schemas import PLAIN

__all__ = ["ContextWindowExceeded", "QuestionTooLong", "DEFAULT_MODE", "MODES", "PLAIN", "AsyncStream", "Comparison", "EncodeReport", "Plan", "PromptCache", "Result", "Sampling", "Stream"]
