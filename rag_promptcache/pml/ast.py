"""The PML syntax tree: plain frozen records, no behaviour beyond lookups.

Schema side: a `Schema` holds `Text`, `Module`, `Union` and `Role` nodes; a `Module` holds `Text`,
`Param`, nested `Module`/`Union` and `Role` nodes. Prompt side: a `Prompt` holds `Text`, `Import` and
`Role` nodes; an `Import` may hold nested `Import`s (importing a nested module under its parent).

Every node carries `line` and `column` (1-based, of its opening `<` or first character) so that the
engine can raise `PMLError` at the right place for problems only it can see (a parameter value
longer than `len` tokens, say).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union as TypingUnion

RoleName = Literal["system", "user", "assistant"]
ROLES: tuple[str, ...] = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class Text:
    text: str  # unescaped
    line: int = 1
    column: int = 1


@dataclass(frozen=True, slots=True)
class Param:
    name: str
    length: int  # maximum number of tokens of a value
    line: int = 1
    column: int = 1


@dataclass(frozen=True, slots=True)
class Role:
    role: RoleName
    children: tuple["Node", ...]
    line: int = 1
    column: int = 1


@dataclass(frozen=True, slots=True)
class Module:
    name: str
    children: tuple["Node", ...]
    line: int = 1
    column: int = 1


@dataclass(frozen=True, slots=True)
class Union:
    modules: tuple[Module, ...]
    line: int = 1
    column: int = 1


Node = TypingUnion[Text, Param, Role, Module, Union]


@dataclass(frozen=True, slots=True)
class Schema:
    name: str
    children: tuple[Node, ...]
    line: int = 1
    column: int = 1
    # name -> module, nested ones included; filled by the parser
    modules: dict[str, Module] = field(default_factory=dict, compare=False, repr=False)
    # name -> name of the enclosing module (None at top level); filled by the parser
    parents: dict[str, str | None] = field(default_factory=dict, compare=False, repr=False)
    # name -> index of the union that holds it, for the ones inside a union; filled by the parser
    union_of: dict[str, int] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Import:
    name: str
    args: tuple[tuple[str, str], ...]  # (param name, unescaped value), in source order
    children: tuple["Import", ...] = ()
    line: int = 1
    column: int = 1


PromptNode = TypingUnion[Text, Import, Role]


@dataclass(frozen=True, slots=True)
class Prompt:
    schema: str
    children: tuple[PromptNode, ...]
    line: int = 1
    column: int = 1
