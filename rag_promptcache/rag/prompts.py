"""Requests from chat frameworks → engine calls, written once for every adapter.

- Module references: `format_refs` writes retrieved chunks as `<module id="m…">text</module>`. Any
  LLM can read that (the text is there); ours import the module's stored KV instead and drop the tag.
  A reference the corpus does not know falls back to its text; one without text is an error.
- `build_prompt`: (role, text) turns + references → a PML prompt, a chat prompt with no schema, or
  plain completion text.
- `generation_options`: framework call options (`max_tokens`, or its other name `max_new_tokens`, …)
  → engine keyword arguments, over `ANSWER_DEFAULTS` (re-exported here from `rag.repetition`: the
  length, greedy sampling and repetition control `ask` answers with) where neither the adapter's
  settings nor the call set one (`no_repeat_ngram=0` is off).
- `result_stats`: an engine `Result` → the statistics adapters report, under the engine's names.

Out of scope: any framework's types (the adapters translate those), retrieval, generation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rag_promptcache.pml import ast
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.pml.parser import escape, unescape
from rag_promptcache.rag.repetition import (ANSWER_DEFAULTS, DEFAULT_NO_REPEAT_NGRAM,  # noqa: F401 - the adapters' defaults, re-exported
                                            AnswerDefaults, answer_options)

if TYPE_CHECKING:
    from rag_promptcache.engine import Result
    from rag_promptcache.rag.corpus import Corpus

ModuleRef = str | tuple[str, str]  # a module id, or (id, text to fall back on)
REFERENCE = re.compile(r'<module id="([^"<>]+)"\s*(?:/>|>(.*?)</module>)', re.S)
OPTIONS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repetition_penalty", "no_repeat_ngram",
           "response_format", "stop_repeats")  # stop_repeats (default True): end at a repeated sentence  # response_format: OpenAI's shapes, constrained decoding (engine/decoding/grammar.py)
ALIASES = {"max_new_tokens": "max_tokens"}  # the CLI's and PromptCache.generate's name (docs/langchain.md)
STATS = ("finish_reason", "ttft_s", "total_s", "prompt_tokens", "cached_tokens", "computed_tokens",
         "hit_modules", "missed_modules", "recomputed_modules", "deferred_modules", "path", "adapter")


def format_refs(refs: Iterable[tuple[str, str]]) -> str:
    """(module id, text) pairs → references, one per line, text escaped."""
    return "\n".join(f'<module id="{escape(i, quote=True)}">{escape(t)}</module>' for i, t in refs)


def build_prompt(
    turns: Sequence[tuple[str, str]],
    *,
    corpus: Corpus | None = None,
    module_ids: Sequence[ModuleRef] = (),
    chat: bool = True,
) -> str | ast.Prompt:
    """Turns whose text may hold references, plus `module_ids` → what `PromptCache.generate` takes.

    Known modules are imported (their KV is reused); unknown ones with text fall back to it: inline
    where the reference stood, or before the last turn's text for `module_ids`. Without imports a
    chat prompt still gets the chat template (the engine's empty schema); a completion is the text
    as is, and PML text passes through unchanged. References and `module_ids` are taken as ranked,
    best first (as retrievers return them); the prompt imports them in `Corpus.order`, best last, next
    to the question, where the default recovery recomputes it (docs/FIDELITY.md)."""
    imports: list[str] = []

    def resolve(module_id: str, text: str | None) -> str:
        if corpus is not None and corpus.has_module(module_id):
            imports.append(module_id)
            return ""
        if text is None:
            where = f"corpus {corpus.path}" if corpus is not None else "this engine (no corpus given)"
            raise ValueError(f"unknown module {module_id!r}: not in {where}, and no text to fall back on")
        return text

    if not chat and len(turns) == 1 and turns[0][1].lstrip().startswith("<prompt"):
        if corpus is not None:
            corpus.prepare()  # the PML may name the corpus schema
        return turns[0][1]
    fallback = [resolve(*((ref, None) if isinstance(ref, str) else ref)) for ref in module_ids]
    resolved: list[tuple[str, str]] = []
    for role, text in turns:
        if REFERENCE.search(text):
            text = REFERENCE.sub(lambda m: resolve(unescape(m.group(1)), _text(m.group(2))), text).strip()
            if not text:  # references only: those modules sit in the corpus schema's system turn
                continue
        resolved.append((role, text))
    if resolved and any(fallback):
        role, text = resolved[-1]
        resolved[-1] = (role, "\n\n".join([*(t for t in fallback if t), text]))
    if not any(t.strip() for _, t in resolved) and not imports:
        raise ValueError("empty prompt: no text and no module references")
    if imports:
        assert corpus is not None
        corpus.prepare()
        return prompt_pml(corpus.manifest.name, corpus.order(list(dict.fromkeys(imports))), resolved)
    if not chat:
        return "\n\n".join(t for _, t in resolved)
    return ast.Prompt("", tuple(ast.Role(r, (ast.Text(t),)) for r, t in resolved))  # type: ignore[arg-type]


def wants_chat(engine: Any, prompt: str) -> bool:
    """Whether a plain completion prompt should get the chat template: yes for a chat-tuned model
    (its tokenizer has a template; it answers nothing sensible to raw text), never for PML."""
    return bool(getattr(engine.tokenizer, "chat_template", None)) and not prompt.lstrip().startswith("<prompt")


def _text(raw: str | None) -> str | None:
    return None if raw is None else unescape(raw)


def generation_options(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Call options over an adapter's `defaults` over `ANSWER_DEFAULTS` (None means unset) → engine
    keyword arguments."""
    if unknown := set(overrides) - set(OPTIONS) - set(ALIASES):
        valid = ", ".join(OPTIONS) + "".join(f" ({alias} = {name})" for alias, name in ALIASES.items())
        raise ValueError(f"unsupported option(s) {sorted(unknown)}; valid: {valid}")
    given = {k: v for k, v in overrides.items() if v is not None}
    for alias, name in ALIASES.items():
        if alias in given:
            value = given.pop(alias)
            if given.setdefault(name, value) != value:
                raise ValueError(f"{name}={given[name]} and {alias}={value} disagree; pass one of them")
    shared = {"max_tokens": ANSWER_DEFAULTS.max_new_tokens, "temperature": ANSWER_DEFAULTS.temperature,
              "no_repeat_ngram": ANSWER_DEFAULTS.no_repeat_ngram}
    merged = {**shared, **{k: v for k, v in defaults.items() if v is not None}, **given}
    max_tokens = merged.get("max_tokens")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    out = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in merged.items() if v is not None}
    out["stop"] = merged.get("stop") or ()  # Sampling makes it a tuple: a bare string is one stop string
    return answer_options(out)


def result_stats(result: Result | None) -> dict[str, Any]:
    return {} if result is None else {n: getattr(result, n) for n in STATS}
