"""LangChain `Document`s → module references, and the engine behind an adapter. Translation only:
how references become imports lives in `rag_promptcache.rag.prompts`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rag_promptcache.rag.prompts import format_refs

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag import Corpus


def format_modules(docs: Iterable[Any]) -> str:
    """Documents from `PromptCacheRetriever` → `<module id="m…">text</module>` references.

    Any LLM can read them; ours import the modules' stored KV instead of re-reading the text."""
    refs = []
    for d in docs:
        module_id = d.metadata.get("module_id")
        if not module_id:
            raise ValueError("format_modules needs Documents from PromptCacheRetriever (metadata['module_id'] is missing)")
        refs.append((module_id, d.page_content))
    return format_refs(refs)


def engine_of(corpus: Corpus | None, engine: PromptCache | None) -> PromptCache:
    if corpus is None and engine is None:
        raise ValueError("pass corpus=Corpus.open(dir) or engine=PromptCache.from_pretrained(name)")
    if corpus is not None and engine is not None and corpus.engine is not engine:
        raise ValueError("pass corpus= or engine=, not both (a corpus brings its own engine)")
    return engine if engine is not None else corpus.engine
