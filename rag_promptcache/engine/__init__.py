"""The engine: compile PML, plan hits and misses, assemble relocated module KV, prefill, decode.

The names below are imported when first used: `PromptCache` brings torch and transformers' model
classes, and a part of the engine a command reads without running a model (the prompt compiler that
`info` and ingest use, the recovery names) must not wait for them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_LAZY = {
    "DEFAULT_MODE": "planning.encoder", "MODES": "planning.encoder",
    "PromptCache": "engine",
    "ContextWindowExceeded": "errors", "QuestionTooLong": "errors",
    "Plan": "planning.plan",
    "AsyncStream": "result", "Comparison": "result", "EncodeReport": "result", "Result": "result", "Stream": "result",
    "Sampling": "decoding.sampling",
    "PLAIN": "prompt.schemas",
}

if TYPE_CHECKING:
    from rag_promptcache.engine.decoding.sampling import Sampling
    from rag_promptcache.engine.engine import PromptCache
    from rag_promptcache.engine.errors import ContextWindowExceeded, QuestionTooLong
    from rag_promptcache.engine.planning.encoder import DEFAULT_MODE, MODES
    from rag_promptcache.engine.planning.plan import Plan
    from rag_promptcache.engine.prompt.schemas import PLAIN
    from rag_promptcache.engine.result import AsyncStream, Comparison, EncodeReport, Result, Stream


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f"rag_promptcache.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'rag_promptcache.engine' has no attribute {name!r}")


__all__ = ["ContextWindowExceeded", "QuestionTooLong", "DEFAULT_MODE", "MODES", "PLAIN", "AsyncStream", "Comparison",
           "EncodeReport", "Plan", "PromptCache", "Result", "Sampling", "Stream"]
