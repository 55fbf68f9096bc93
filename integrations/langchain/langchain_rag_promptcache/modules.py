"""Module references inside ordinary prompt text, and turning (role, text) turns into an engine prompt.

`format_modules(docs)` writes each retrieved document as `<module id="m…">text</module>`. Any LLM can
read that (the text is there, so `HuggingFacePipeline` works unchanged); our LLMs import the module's
stored KV instead, and put the rest of the text in the user turn. A reference the corpus does not know
falls back to its text; one without text is an error naming the id.

TO MOVE TO CORE (`rag_promptcache.pml.build` / `rag.Corpus`): this is prompt construction, not type
translation. Out of scope: retrieval, generation.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rag_promptcache.pml import ast
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.pml.parser import escape, unescape

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag import Corpus

MODULE_REF = re.compile(r'<module id="([^"<>]+)"\s*(?:/>|>(.*?)</module>)', re.S)
PLAIN = ""  # the engine's built-in empty schema


def format_modules(docs: Iterable[Any]) -> str:
    """Documents with `metadata["module_id"]` → module references (text kept, escaped)."""
    parts = []
    for d in docs:
        module_id = d.metadata.get("module_id")
        if not module_id:
            raise ValueError("format_modules needs Documents from PromptCacheRetriever (metadata['module_id'] is missing)")
        parts.append(f'<module id="{escape(module_id, quote=True)}">{escape(d.page_content)}</module>')
    return "\n".join(parts)


def engine_of(corpus: Corpus | None, engine: PromptCache | None) -> PromptCache:
    if corpus is None and engine is None:
        raise ValueError("pass corpus=Corpus.open(dir) or engine=PromptCache.from_pretrained(name)")
    if corpus is not None and engine is not None and corpus.engine is not engine:
        raise ValueError("pass corpus= or engine=, not both (a corpus brings its own engine)")
    return engine if engine is not None else corpus.engine


def build_prompt(corpus: Corpus | None, turns: Sequence[tuple[str, str]], chat: bool) -> str | ast.Prompt:
    """Turns whose text may hold module references → a PML prompt importing the known modules.

    Without imports, a non-chat prompt is the text itself (generated as is) and a chat prompt uses
    the engine's empty schema, so the chat template still applies."""
    imports: list[str] = []

    def resolve(match: re.Match[str]) -> str:
        module_id, text = unescape(match.group(1)), match.group(2)
        if corpus is not None and corpus.table.has_module(module_id):
            imports.append(module_id)
            return ""
        if text is None:
            where = f"corpus {corpus.path}" if corpus is not None else "this engine (no corpus given)"
            raise ValueError(f"unknown module {module_id!r}: not in {where}, and the reference carries no text to fall back on")
        return unescape(text)

    resolved = []
    for role, text in turns:
        if MODULE_REF.search(text):
            text = MODULE_REF.sub(resolve, text).strip()
            if not text:  # a message of references only: its modules sit in the corpus schema's system turn
                continue
        resolved.append((role, text))
    if not any(t.strip() for _, t in resolved) and not imports:
        raise ValueError("empty prompt: no text and no module references")
    if imports:
        assert corpus is not None
        return prompt_pml(register(corpus), dict.fromkeys(imports), resolved)
    if not chat:
        return "".join(t for _, t in resolved)
    return ast.Prompt(PLAIN, tuple(ast.Role(role, (ast.Text(t),)) for role, t in resolved))  # type: ignore[arg-type]


def register(corpus: Corpus) -> str:
    """Make sure the engine holds the corpus schema (`Corpus.prepare`: once per table change); → its name."""
    corpus.prepare()
    return corpus.manifest.name


SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed")


def sampling(defaults: dict[str, Any], stop: Sequence[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Framework call options → engine keyword arguments (`max_tokens` → `max_new_tokens`)."""
    if unknown := set(kwargs) - set(SAMPLING):
        raise ValueError(f"unsupported option(s) {sorted(unknown)}; valid: {', '.join(SAMPLING)}, stop")
    merged = {**defaults, **{k: v for k, v in kwargs.items() if v is not None}}
    if merged["max_tokens"] is not None and merged["max_tokens"] <= 0:
        raise ValueError(f"max_tokens must be at least 1, got {merged['max_tokens']}")
    out = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in merged.items() if v is not None}
    out["stop"] = tuple(stop or ())
    return out


def result_info(result: Any) -> dict[str, Any]:
    """The engine's `Result` statistics, under the engine's own names."""
    names = ("finish_reason", "ttft_s", "total_s", "prompt_tokens", "cached_tokens", "computed_tokens",
             "hit_modules", "missed_modules", "recomputed_modules")
    return {n: getattr(result, n) for n in names}


async def pieces(stream: Any) -> AsyncIterator[str]:
    """A sync engine `Stream` → async text pieces; `stream.result` is set at the end.

    CORE GAP: `PromptCache.astream` yields text only, never the `Result`. One thread per stream
    (the engine once kept `inference_mode` thread-locally across steps; harmless now)."""
    done = object()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(max_workers=1) as thread:
        while (piece := await loop.run_in_executor(thread, next, stream, done)) is not done:
            yield piece
