"""`Schemas`: the engine's registry of PML schemas, their compilations and their modules' store keys.

A schema is compiled once per (chat, default system turn) pair, and each module's store key (a content
address: engine/../store/base.py `module_key`) is memoised per compilation. Replacing a schema drops
both. Thread-safe: one lock around the maps.

Out of scope: planning a prompt (engine/planning/plan.py), tokenizing and compiling (engine/prompt/compiler.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rag_promptcache.engine.prompt.compiler import CompiledSchema, Compiler, Layout, Piece, Unit
from rag_promptcache.pml import ast
from rag_promptcache.pml.build import to_pml
from rag_promptcache.pml.parser import parse_prompt, parse_schema
from rag_promptcache.store.base import module_key

PLAIN = ""  # the empty schema that plain-text prompts use


@dataclass(frozen=True, slots=True)
class Compiled:
    """A prompt compiled against its schema: its pieces in sequence order, and how it was compiled."""

    schema: CompiledSchema
    pieces: tuple[Piece, ...]
    chat: bool
    default_system: bool


class Schemas:
    def __init__(self, compiler: Compiler, fingerprint: str, mode: str) -> None:
        self.compiler = compiler
        self.fingerprint = fingerprint
        self.mode = mode
        self._schemas: dict[str, ast.Schema] = {PLAIN: ast.Schema(PLAIN, ())}
        self._chat: dict[str, bool] = {PLAIN: False}  # whether a schema uses role tags: once, not per request
        self._first_role: dict[str, str | None] = {PLAIN: None}  # its first role tag, in document order
        self._compiled: dict[tuple[str, bool, bool], CompiledSchema] = {}
        self._keys: dict[tuple[str, bool, bool, str], str] = {}
        self._lock = threading.Lock()  # the schema, compiled-schema and key maps

    def add(self, schema: str | ast.Schema, *, replace: bool = False) -> ast.Schema:
        """Register a schema, given as PML or as a parsed `Schema`. Registering the same content
        again is a no-op; a name already registered to other content needs `replace=True`."""
        parsed = parse_schema(schema) if isinstance(schema, str) else schema
        if not parsed.name:
            raise ValueError("a schema needs a non-empty name (the empty name is the engine's plain-prompt schema)")
        with self._lock:
            old = self._schemas.get(parsed.name)
            if old is not None and _same_schema(old, parsed):
                return old
            if old is not None and not replace:
                raise ValueError(f"schema {parsed.name!r} is already registered with other content; "
                                 "pass replace=True to replace it, or register it under another name")
            self._schemas[parsed.name] = parsed
            self._chat[parsed.name] = _uses_roles(parsed.children)
            self._first_role[parsed.name] = _first_role(parsed.children)
            self._compiled = {k: v for k, v in self._compiled.items() if k[0] != parsed.name}
            self._keys = {k: v for k, v in self._keys.items() if k[0] != parsed.name}
        return parsed

    def get(self, name: str) -> ast.Schema:
        if name not in self._schemas:
            known = ", ".join(repr(n) for n in sorted(self._schemas) if n != PLAIN) or "none"
            raise ValueError(f"unknown schema {name!r}; known: {known}")
        return self._schemas[name]

    def parse(self, prompt: str | ast.Prompt) -> ast.Prompt:
        """A prompt as PML (`<prompt schema=...>`), plain text, or already parsed → `ast.Prompt`."""
        if isinstance(prompt, ast.Prompt):
            return prompt
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is PML or plain text (str), got {type(prompt).__name__}")
        if prompt.lstrip().startswith("<prompt"):
            return parse_prompt(prompt, self._schemas)
        return ast.Prompt(PLAIN, (ast.Text(prompt),))

    def chat_of(self, name: str, prompt_children: Sequence[ast.PromptNode] = ()) -> tuple[bool, bool]:
        """(whether the sequence is a conversation, whether the template's default system turn opens
        it: its first role, the schema's or else the prompt's, is not a system message)."""
        schema = self.get(name).name
        chat = self._chat[schema] or _uses_roles(prompt_children)
        first = self._first_role[schema] or _first_role(prompt_children)
        return chat, chat and bool(self.compiler.markup.default_system) and first != "system"

    def compile(self, name: str, chat: bool, default_system: bool = False) -> CompiledSchema:
        with self._lock:
            compiled = self._compiled.get((name, chat, default_system))
            if compiled is None:
                compiled = self.compiler.compile_schema(self.get(name), chat, default_system)
                self._compiled[(name, chat, default_system)] = compiled
            return compiled

    def compile_prompt(self, prompt: str | ast.Prompt, layout: Layout = "contiguous") -> Compiled:
        """The prompt's pieces, as every request plans them (engine/planning/plan.py) and as tuning masks them
        (rag_promptcache/tune/layout.py). No store, no model."""
        parsed = self.parse(prompt)
        chat, default = self.chat_of(parsed.schema, parsed.children)
        compiled = self.compile(parsed.schema, chat, default)
        return Compiled(compiled, tuple(self.compiler.compile_prompt(compiled, parsed, layout)), chat, default)

    def key(self, compiled: CompiledSchema, unit: Unit, chat: bool, default_system: bool = False) -> str:
        """The store key of `unit`'s KV in this compilation."""
        memo = (compiled.name, chat, default_system, unit.name, bool(unit.neighbour_ids))  # plain or after neighbours
        with self._lock:
            key = self._keys.get(memo)
        if key is None:
            context = unit.context_ids if self.mode == "shared_prefix" else ()
            key = module_key(self.fingerprint, self.mode, unit.token_ids, unit.encode_start, context,
                             unit.neighbour_ids, unit.byproduct)
            with self._lock:  # memoised only for the current compilation: a schema may be replaced meanwhile
                if self._compiled.get((compiled.name, chat, default_system)) is compiled:
                    self._keys[memo] = key
        return key

    def module_keys(self, name: str, module_names: Sequence[str]) -> dict[str, str]:
        """The store key of each named module of schema `name`, compiled as a prompt without roles of its own
        would compile it (what `PromptCache.encode` stores)."""
        chat, default = self.chat_of(name)
        compiled = self.compile(name, chat, default)
        for m in module_names:
            if m not in compiled.units:
                raise ValueError(f"schema {name!r} has no module {m!r}")
        return {m: self.key(compiled, compiled.units[m], chat, default) for m in module_names}


def _same_schema(a: ast.Schema, b: ast.Schema) -> bool:
    """The same content, wherever it was written: positions in the PML source do not count. Neighbours
    (which PML does not write) count."""
    return to_pml(a) == to_pml(b) and ((a.neighbours, a.neighbours_present, a.byproduct)
                                       == (b.neighbours, b.neighbours_present, b.byproduct))


def _first_role(nodes: Iterable[object]) -> str | None:
    for n in nodes:
        if isinstance(n, ast.Role):
            return n.role
        children = getattr(n, "children", None) or getattr(n, "modules", None)
        if children and (role := _first_role(children)) is not None:
            return role
    return None


def _uses_roles(nodes: Iterable[object]) -> bool:
    for n in nodes:
        if isinstance(n, ast.Role):
            return True
        children = getattr(n, "children", None) or getattr(n, "modules", None)
        if children and _uses_roles(children):
            return True
    return False
