"""The PML syntax tree: plain frozen records, no behaviour beyond lookups.

Schema side: a `Schema` holds `Text`, `Module`, `Union` and `Role` nodes; a `Module` holds `Text`,
`Param`, nested `Module`/`Union` and `Role` nodes. Prompt side: a `Prompt` holds `Text`, `Import` and
`Role` nodes; an `Import` may hold nested `Import`s (importing a nested module under its parent).

Every node carries `line` and `column` (1-based, of its opening `<` or first character) so that the
engine can raise `PMLError` at the right place for problems only it can see (a parameter value
longer than `len` tokens, say).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Union as TypingUnion

RoleName = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = ("system", "user", "assistant")


def _pos() -> int:
    # Positions say where a node was written, not what it is: they stay out of `==` and `hash`, so
    # a tree re-parsed from `to_pml` output (or built by hand) equals the original.
    return field(default=1, compare=False)


@dataclass(frozen=True, slots=True)
class Text:
    text: str  # unescaped
    line: int = _pos()
    column: int = _pos()


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    length: int  # maximum number of tokens of a value
    line: int = _pos()
    column: int = _pos()


@dataclass(frozen=True, slots=True)
class Role:
    role: RoleName
    children: tuple["Node", ...]
    line: int = _pos()
    column: int = _pos()


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    children: tuple["Node", ...]
    line: int = _pos()
    column: int = _pos()

    @property
    def params(self) -> tuple[Param, ...]:
        """This module's own params, in order (inside its roles too; not those of nested modules)."""
        return tuple(_own_params(self.children))


@dataclass(frozen=True, slots=True)
class Union:
    modules: tuple[Module, ...]
    line: int = _pos()
    column: int = _pos()


Node = TypingUnion[Text, Param, Role, Module, Union]


def _own_params(nodes: tuple[Node, ...]) -> Iterator[Param]:
    for node in nodes:
        if isinstance(node, Param):
            yield node
        elif isinstance(node, Role):
            yield from _own_params(node.children)


@dataclass(frozen=True, slots=True)
class Schema:
    name: str
    children: tuple[Node, ...]
    line: int = _pos()
    column: int = _pos()
    # name -> module, nested ones included; filled by the parser
    modules: dict[str, Module] = field(default_factory=dict, compare=False, repr=False)
    # name -> name of the enclosing module (None at top level); filled by the parser
    parents: dict[str, str | None] = field(default_factory=dict, compare=False, repr=False)
    # name -> index of the union that holds it, for the ones inside a union; filled by the parser
    union_of: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    # name -> names of other modules of this schema whose text precedes it when it is encoded, in order
    # (the last right before it): the module is encoded after its context and their tokens, only its own
    # KV kept, moved back to its usual position (engine/planning/encoder.py). Names, not texts: a
    # neighbour is tokenized exactly as the module it names (wrapper tokens, the same splits), the schema
    # stays the one place a text lives, and a text shared by many modules' lists is held once. Set in
    # Python only (PML has no syntax for it); empty for every parsed schema.
    neighbours: dict[str, tuple[str, ...]] = field(default_factory=dict, compare=False, repr=False)
    # a prompt reads a module's KV encoded after its neighbours only where at least this many of them are in
    # the same prompt, its plain KV (encoded without them) otherwise; 0: always. Python only, as `neighbours`.
    neighbours_present: int = field(default=0, compare=False, repr=False)
    # whether a module's KV, where it is missing, is kept from the prefill of the question that retrieved it
    # (each module encoded after the modules before it in that prompt, keys moved back to its usual
    # position: engine/kv/byproduct.py) rather than encoded on its own. Python only, as `neighbours`.
    byproduct: bool = field(default=False, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Import:
    name: str
    args: tuple[tuple[str, str], ...]  # (param name, unescaped value), in source order
    children: tuple["Import", ...] = ()
    line: int = _pos()
    column: int = _pos()


PromptNode = TypingUnion[Text, Import, Role]


@dataclass(frozen=True, slots=True)
class Prompt:
    schema: str
    children: tuple[PromptNode, ...]
    line: int = _pos()
    column: int = _pos()
