"""Writing prompt PML from Python values, so callers never hand-escape text.

Used by the RAG pipeline and the framework adapters alike: retrieved modules first (in the order
given), then the conversation turns. Only builds strings; parsing and validation stay in parser.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from rag_promptcache.pml.ast import ROLES
from rag_promptcache.pml.parser import escape


def prompt_pml(
    schema: str,
    modules: Iterable[str | tuple[str, Mapping[str, str]]] = (),
    turns: Sequence[tuple[str, str]] = (),
    text: str = "",
) -> str:
    """`<prompt schema=…>` importing `modules` (names, or (name, {param: value})), then `turns`
    as (role, text) pairs with role in system/user/assistant, then raw `text`."""
    parts = [f'<prompt schema="{escape(schema, quote=True)}">']
    for m in modules:
        name, args = (m, {}) if isinstance(m, str) else m
        attrs = "".join(f' {k}="{escape(v, quote=True)}"' for k, v in args.items())
        parts.append(f"<{name}{attrs}/>")
    for role, content in turns:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; valid: {', '.join(ROLES)}")
        parts.append(f"<{role}>{escape(content)}</{role}>")
    parts.append(escape(text))
    parts.append("</prompt>")
    return "".join(parts)
