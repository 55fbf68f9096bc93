"""Writing PML: prompts from Python values, so callers never hand-escape text, and any parsed tree
back as text (`to_pml`).

`prompt_pml` serves the RAG pipeline and the framework adapters alike: retrieved modules first (in
the order given), then the conversation turns. Only builds strings; parsing and validation stay in
parser.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from rag_promptcache.pml.ast import ROLES, Import, Module, Node, Param, Prompt, Role, Schema, Text, Union
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


def to_pml(node: Schema | Prompt | Node | Import) -> str:
    """Write a tree back as PML (escaped, attributes double-quoted, no comments)."""
    match node:
        case Text():
            return escape(node.text)
        case Schema():
            return _tag("schema", [("name", node.name)], node.children)
        case Module():
            return _tag("module", [("name", node.name)], node.children)
        case Union():
            return _tag("union", [], node.modules)
        case Param():
            return _tag("param", [("name", node.name), ("len", str(node.length))], None)
        case Role():
            return _tag(node.role, [], node.children)
        case Prompt():
            return _tag("prompt", [("schema", node.schema)], node.children)
        case Import():
            return _tag(node.name, list(node.args), node.children or None)
    raise TypeError(f"not a PML node: {node!r}")


def _tag(name: str, attrs: list[tuple[str, str]], children: Sequence[object] | None) -> str:
    head = name + "".join(f' {key}="{escape(value, quote=True)}"' for key, value in attrs)
    if children is None:
        return f"<{head}/>"
    return f"<{head}>{''.join(to_pml(kid) for kid in children)}</{name}>"  # type: ignore[arg-type]
