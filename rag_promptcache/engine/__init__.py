"""The engine: compile PML, plan hits and misses, assemble relocated module KV, prefill, decode.

One package per step of a request, in the order it takes them: `prompt` (compile), `planning` (plan,
recovery, the cost model, prefill), `prefix` (the prefix cache), `kv` (assembly), `compute` (the
forward), `decoding`; `batching` runs many requests through the same steps, and `engine.py`
(`PromptCache`) wires them (docs/ARCHITECTURE.md, "One request's path")."""

from rag_promptcache.engine.planning.encoder import DEFAULT_MODE, MODES
from rag_promptcache.engine.engine import PromptCache
from rag_promptcache.engine.errors import ContextWindowExceeded
from rag_promptcache.engine.planning.plan import Plan
from rag_promptcache.engine.result import AsyncStream, Comparison, EncodeReport, Result, Stream
from rag_promptcache.engine.decoding.sampling import Sampling
from rag_promptcache.engine.prompt.schemas import PLAIN

__all__ = ["ContextWindowExceeded", "DEFAULT_MODE", "MODES", "PLAIN", "AsyncStream", "Comparison", "EncodeReport", "Plan", "PromptCache", "Result", "Sampling", "Stream"]
