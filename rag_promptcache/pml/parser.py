"""Parse and validate PML (Prompt Cache, paper §3.2): schemas, and prompts that import from them.

A small hand-written scanner turns the source into a generic element tree with exact positions;
`parse_schema` and `parse_prompt` turn that into `pml.ast` records and check each side's rules.
Out of scope: tokens (a parameter value's length in tokens is checked by the engine), and which
whitespace matters (text is kept exactly; the engine decides what to drop).

The syntax is a strict subset of XML:
- One root element (`<schema name="...">` or `<prompt schema="...">`); only whitespace and
  comments around it. Comments `<!-- ... -->` are dropped, and the text on either side of one
  becomes a single `Text`. DOCTYPE, CDATA and `<?...?>` are errors.
- Escaping, in text and in quoted attribute values alike: `&lt;` `&gt;` `&amp;` `&quot;` `&apos;`,
  `&#NN;` (decimal) and `&#xHH;` (hex). A literal `<` must be written `&lt;`, and a `&` that does
  not start one of these entities is an error; a literal `>` is fine. `escape(s)` escapes `& < >`,
  `escape(s, quote=True)` also `" '` (for attribute values), and `unescape(escape(s)) == s`.
- Tag and attribute names: a letter or `_`, then letters, digits, `_`, `-`, `.`. Attribute values
  are quoted with `"` or `'`; an attribute appears at most once per tag.
- `to_pml(tree)` (build.py) writes a tree back: `parse_schema(to_pml(schema)) == schema` (positions take no
  part in `==`; comments and whitespace inside `<union>` or between nested imports are not kept).

Errors are `PMLError(message, line, column)`, 1-based, at the offending `<` or character; an
unclosed tag is reported at the end of the input, naming where it was opened.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rag_promptcache.pml.ast import (
    ROLES, Import, Module, Node, Param, Prompt, PromptNode, Role, Schema, Text, Union,
)
from rag_promptcache.pml.errors import PMLError

_NAME = re.compile(r"[^\W\d][\w.-]*")
_WS = re.compile(r"[ \t\r\n]*")  # XML's whitespace, between attributes
_ENTITY = re.compile(r"&(?:(lt|gt|amp|quot|apos)|#([0-9]{1,8})|#x([0-9a-fA-F]{1,6}));")
_NAMED = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}
# schema-side tag -> its valid attributes
_SCHEMA_TAGS: dict[str, tuple[str, ...]] = {
    "module": ("name",), "union": (), "param": ("name", "len"), **{role: () for role in ROLES},
}


def escape(text: str, quote: bool = False) -> str:
    """Escape `&`, `<`, `>` for PML text; with `quote=True` also `"` and `'` (attribute values)."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return text.replace('"', "&quot;").replace("'", "&apos;") if quote else text


def unescape(text: str) -> str:
    """Decode PML entities; a bad entity or bare `&` raises `PMLError` at its place in `text`."""
    return _Scanner(text).decode(0, len(text))


@dataclass(slots=True)
class _Attr:
    name: str
    value: str  # unescaped
    line: int
    column: int


@dataclass(slots=True)
class _Elem:
    name: str
    line: int
    column: int
    attrs: dict[str, _Attr] = field(default_factory=dict)
    children: list[_Elem | Text] = field(default_factory=list)


class _Scanner:
    """Source text -> one root `_Elem`, with well-formedness (not schema or prompt rules) checked."""

    def __init__(self, src: str) -> None:
        self.src = src
        self.pos = 0
        self.line_starts = [0] + [i + 1 for i, ch in enumerate(src) if ch == "\n"]

    def at(self, pos: int) -> tuple[int, int]:
        i = bisect_right(self.line_starts, pos) - 1
        return i + 1, pos - self.line_starts[i] + 1

    def error(self, message: str, pos: int) -> PMLError:
        return PMLError(message, *self.at(pos))

    def decode(self, start: int, end: int) -> str:
        src, out, i = self.src, [], start
        while (amp := src.find("&", i, end)) >= 0:
            out.append(src[i:amp])
            m = _ENTITY.match(src, amp, end)
            if m is None:
                word = re.compile(r"&[#\w]*;?").match(src, amp, end).group()
                if not word.endswith(";"):
                    raise self.error("bare '&': write &amp; for a literal '&' (an entity ends "
                                     "with ';')", amp)
                raise self.error(f"bad entity {word!r}; valid: &lt; &gt; &amp; &quot; &apos; "
                                 "&#NN; &#xHH; (write &amp; for a literal '&')", amp)
            named, dec, hexa = m.groups()
            code = int(dec) if dec else int(hexa, 16) if hexa else -1
            if named is None and (code > 0x10FFFF or 0xD800 <= code <= 0xDFFF):
                raise self.error(f"entity {m.group()!r} is not a valid character", amp)
            out.append(_NAMED[named] if named else chr(code))
            i = m.end()
        out.append(src[i:end])
        return "".join(out)

    def document(self, root: str) -> _Elem:
        src, n = self.src, len(self.src)
        stack: list[_Elem] = []
        found: _Elem | None = None
        while self.pos < n:
            start = self.pos
            if src[start] != "<":
                end = self.pos = n if (lt := src.find("<", start)) < 0 else lt
                if stack:
                    self._add_text(stack[-1], start, end)
                elif (chunk := src[start:end]).strip():
                    where = f"after the root </{root}>" if found else f"before the root <{root}>"
                    raise self.error(f"text {where}", start + len(chunk) - len(chunk.lstrip()))
            elif src.startswith("<!--", start):
                if (end := src.find("-->", start + 4)) < 0:
                    raise self.error("unterminated comment '<!--'", start)
                self.pos = end + 3
            elif src.startswith(("<!", "<?"), start):
                raise self.error("DOCTYPE, CDATA and processing instructions (<!... and <?...) "
                                 "are not PML", start)
            elif src.startswith("</", start):
                name = self._close_tag()
                if not any(e.name == name for e in stack):
                    raise self.error(f"unexpected closing tag </{name}>: no <{name}> is open", start)
                if (top := stack.pop()).name != name:
                    raise self.error(f"mismatched closing tag </{name}>: <{top.name}> opened at line "
                                     f"{top.line}, column {top.column} must be closed first", start)
            else:
                elem, closed = self._open_tag()
                if stack:
                    stack[-1].children.append(elem)
                elif found:
                    raise self.error(f"<{elem.name}> after the root </{root}>: one root only", start)
                elif elem.name != root:
                    raise self.error(f"expected the root <{root}>, found <{elem.name}>", start)
                else:
                    found = elem
                if not closed:
                    stack.append(elem)
        if stack:
            top = stack[-1]
            raise self.error(f"unclosed <{top.name}> opened at line {top.line}, column {top.column}", n)
        if found is None:
            raise self.error(f"no <{root}> root element", n)
        return found

    def _add_text(self, parent: _Elem, start: int, end: int) -> None:
        text, kids = self.decode(start, end), parent.children
        if kids and isinstance(prev := kids[-1], Text):  # only a comment came between them
            kids[-1] = Text(prev.text + text, prev.line, prev.column)
        else:
            kids.append(Text(text, *self.at(start)))

    def _skip_ws(self) -> bool:
        start, self.pos = self.pos, _WS.match(self.src, self.pos).end()
        return self.pos > start

    def _name(self, pos: int, kind: str, err_pos: int) -> str:
        if (m := _NAME.match(self.src, pos)) is None:
            found = repr(self.src[pos]) if pos < len(self.src) else "the end of input"
            hint = " (write &lt; for a literal '<')" if kind == "tag" else ""
            raise self.error(f"invalid {kind} name: found {found}{hint}", err_pos)
        self.pos = m.end()
        return m.group()

    def _open_tag(self) -> tuple[_Elem, bool]:
        """`<name attr="v" ...>` or `.../>` at `self.pos`; returns the element and if it closed."""
        src, start = self.src, self.pos
        elem = _Elem(self._name(start + 1, "tag", start), *self.at(start))
        while True:
            spaced = self._skip_ws()
            if src.startswith("/>", self.pos) or src.startswith(">", self.pos):
                closed = src[self.pos] == "/"
                self.pos += 2 if closed else 1
                return elem, closed
            if self.pos >= len(src):
                raise self.error(f"unterminated tag <{elem.name}: no '>'", start)
            if not spaced:
                raise self.error(f"expected whitespace, '>' or '/>' in <{elem.name}>, "
                                 f"found {src[self.pos]!r}", self.pos)
            attr = self._attr(elem.name)
            if attr.name in elem.attrs:
                raise PMLError(f"duplicate attribute {attr.name!r} on <{elem.name}>",
                               attr.line, attr.column)
            elem.attrs[attr.name] = attr

    def _attr(self, tag: str) -> _Attr:
        src, start = self.src, self.pos
        name = self._name(start, "attribute", start)
        self._skip_ws()
        if not src.startswith("=", self.pos):
            raise self.error(f"expected '=' after attribute {name!r} on <{tag}>", self.pos)
        self.pos += 1
        self._skip_ws()
        if (quote := src[self.pos:self.pos + 1]) not in ('"', "'") or not quote:
            raise self.error(f"the value of attribute {name!r} on <{tag}> must be quoted", self.pos)
        if (end := src.find(quote, self.pos + 1)) < 0:
            raise self.error(f"unterminated value of attribute {name!r} on <{tag}>", self.pos)
        if (lt := src.find("<", self.pos + 1, end)) >= 0:
            raise self.error(f"'<' in the value of attribute {name!r} on <{tag}> (unterminated "
                             "value? write &lt; for a literal '<')", lt)
        value, self.pos = self.decode(self.pos + 1, end), end + 1
        return _Attr(name, value, *self.at(start))

    def _close_tag(self) -> str:
        name = self._name(self.pos + 2, "tag", self.pos)
        self._skip_ws()
        if not self.src.startswith(">", self.pos):
            raise self.error(f"expected '>' to end </{name}", self.pos)
        self.pos += 1
        return name


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(names[:5]) or "none"
    return shown + (f" … and {len(names) - 5} more" if len(names) > 5 else "")


def _check_attrs(elem: _Elem, valid: tuple[str, ...]) -> None:
    for attr in elem.attrs.values():
        if attr.name not in valid:
            raise PMLError(f"unknown attribute {attr.name!r} on <{elem.name}>; valid: "
                           f"{', '.join(valid) or 'none'}", attr.line, attr.column)


def _required(elem: _Elem, name: str) -> _Attr:
    if (attr := elem.attrs.get(name)) is None:
        raise PMLError(f"<{elem.name}> needs a {name!r} attribute", elem.line, elem.column)
    if not attr.value.strip():
        raise PMLError(f"empty {name!r} attribute on <{elem.name}>", attr.line, attr.column)
    return attr


def _first_char(text: Text) -> tuple[int, int]:
    """Where the first non-whitespace character of `text` is (assuming no entity in the lead)."""
    lead = text.text[: len(text.text) - len(text.text.lstrip())]
    if "\n" not in lead:
        return text.line, text.column + len(lead)
    return text.line + lead.count("\n"), len(lead) - lead.rfind("\n")


def parse_schema(text: str) -> Schema:
    """Parse one `<schema name="...">` and index its modules (nested too), parents and unions."""
    root = _Scanner(text).document("schema")
    _check_attrs(root, ("name",))
    name, builder = _required(root, "name").value, _SchemaBuilder()
    children = builder.children(root, None, False)
    return Schema(name, children, root.line, root.column,
                  builder.modules, builder.parents, builder.union_of)


class _SchemaBuilder:
    def __init__(self) -> None:
        self.modules: dict[str, Module] = {}
        self.parents: dict[str, str | None] = {}
        self.union_of: dict[str, int] = {}
        self.defined: dict[str, _Elem] = {}
        self.num_unions = 0

    def children(self, elem: _Elem, module: str | None, in_role: bool) -> tuple[Node, ...]:
        return tuple(kid if isinstance(kid, Text) else self.node(kid, module, in_role)
                     for kid in elem.children)

    def node(self, e: _Elem, module: str | None, in_role: bool) -> Node:
        if e.name not in _SCHEMA_TAGS:
            raise PMLError(f"unknown tag <{e.name}> in a schema; valid: {', '.join(_SCHEMA_TAGS)}",
                           e.line, e.column)
        _check_attrs(e, _SCHEMA_TAGS[e.name])
        if e.name == "module":
            return self.module(e, module, in_role)
        if e.name == "union":
            return self.union(e, module, in_role)
        if e.name == "param":
            return self.param(e, module)
        if in_role:
            raise PMLError(f"<{e.name}> inside another role: roles don't nest", e.line, e.column)
        return Role(e.name, self.children(e, module, True), e.line, e.column)  # type: ignore[arg-type]

    def module(self, e: _Elem, parent: str | None, in_role: bool) -> Module:
        name = (attr := _required(e, "name")).value
        if not _NAME.fullmatch(name) or name in ROLES:
            raise PMLError(f"invalid module name {name!r}: prompts import it as a tag, so it needs "
                           "a letter or '_', then letters, digits, '_', '-', '.', and must not be "
                           f"a role ({', '.join(ROLES)})", attr.line, attr.column)
        if (first := self.defined.get(name)) is not None:
            raise PMLError(f"duplicate module name {name!r} (first at line {first.line}, column "
                           f"{first.column})", e.line, e.column)
        self.defined[name] = e  # before the children, so a nested namesake is the duplicate
        self.parents[name] = parent
        module = Module(name, self.children(e, name, in_role), e.line, e.column)
        seen: set[str] = set()
        for param in module.params:
            if param.name in seen:
                raise PMLError(f"duplicate param {param.name!r} in module {name!r}",
                               param.line, param.column)
            seen.add(param.name)
        self.modules[name] = module
        return module

    def union(self, e: _Elem, module: str | None, in_role: bool) -> Union:
        index, self.num_unions = self.num_unions, self.num_unions + 1
        members: list[Module] = []
        for kid in e.children:
            if isinstance(kid, Text):
                if kid.text.strip():
                    raise PMLError("text inside <union>: a union holds only <module>s",
                                   *_first_char(kid))
                continue
            if kid.name != "module":
                raise PMLError(f"<{kid.name}> inside <union>: a union holds only <module>s",
                               kid.line, kid.column)
            members.append(self.node(kid, module, in_role))  # type: ignore[arg-type]
            self.union_of[members[-1].name] = index
        if not members:
            raise PMLError("empty <union>: it needs at least one <module>", e.line, e.column)
        return Union(tuple(members), e.line, e.column)

    def param(self, e: _Elem, module: str | None) -> Param:
        if module is None:
            raise PMLError("<param> outside a module: a param belongs to the module holding it",
                           e.line, e.column)
        if e.children:
            raise PMLError("<param> must be empty: write <param name=... len=.../>", e.line, e.column)
        name, length = _required(e, "name"), _required(e, "len")
        if not _NAME.fullmatch(name.value):
            raise PMLError(f"invalid param name {name.value!r}: prompts pass it as an attribute",
                           name.line, name.column)
        if not re.fullmatch(r"[0-9]+", length.value) or int(length.value) == 0:
            raise PMLError(f"bad len {length.value!r} on <param name={name.value!r}>: expected a "
                           "positive integer (a number of tokens)", length.line, length.column)
        return Param(name.value, int(length.value), e.line, e.column)


def parse_prompt(text: str, schemas: Mapping[str, Schema]) -> Prompt:
    """Parse one `<prompt schema="...">` and check its imports against that schema."""
    root = _Scanner(text).document("prompt")
    _check_attrs(root, ("schema",))
    attr = _required(root, "schema")
    if (schema := schemas.get(attr.value)) is None:
        raise PMLError(f"unknown schema {attr.value!r}; known: {_few(sorted(n for n in schemas if n))}",
                       attr.line, attr.column)
    importer = _Importer(schema)
    children: list[PromptNode] = []
    for kid in root.children:
        if isinstance(kid, Text):
            children.append(kid)
        elif kid.name in ROLES:
            _check_attrs(kid, ())
            for inner in kid.children:
                if not isinstance(inner, Text):
                    raise PMLError(f"<{inner.name}> inside <{kid.name}>: a prompt's roles hold "
                                   "only text (import modules outside roles)", inner.line, inner.column)
            children.append(Role(kid.name, tuple(kid.children), kid.line, kid.column))  # type: ignore[arg-type]
        else:
            children.append(importer.load(kid, None))
    return Prompt(attr.value, tuple(children), root.line, root.column)


class _Importer:
    """Checks imports against one schema: known, at the right nesting, once, one per union."""

    def __init__(self, schema: Schema) -> None:
        self.schema = schema
        self.seen: dict[str, _Elem] = {}
        self.union_pick: dict[int, str] = {}

    def load(self, e: _Elem, parent: str | None) -> Import:
        schema, name = self.schema, e.name
        if name not in schema.modules:
            here = [m for m, p in schema.parents.items() if p == parent]
            where = f"inside <{parent}>" if parent else "at the top level"
            raise PMLError(f"unknown module {name!r} in schema {schema.name!r}; valid {where}: "
                           f"{_few(here)}", e.line, e.column)
        if (home := schema.parents[name]) != parent:
            fix = f"nested in {home!r}: import it inside <{home}>…</{home}>" if home else \
                f"a top-level module, not nested in {parent!r}: import it at the top level"
            raise PMLError(f"module {name!r} is {fix}", e.line, e.column)
        if (first := self.seen.get(name)) is not None:
            raise PMLError(f"module {name!r} imported twice (first at line {first.line}, column "
                           f"{first.column})", e.line, e.column)
        if (union := schema.union_of.get(name)) is not None:
            if (other := self.union_pick.get(union)) is not None:
                raise PMLError(f"modules {other!r} and {name!r} are in one <union>: import at most "
                               "one of them", e.line, e.column)
            self.union_pick[union] = name
        valid = [p.name for p in schema.modules[name].params]
        for attr in e.attrs.values():
            if attr.name not in valid:
                raise PMLError(f"unknown parameter {attr.name!r} for module {name!r}; valid: "
                               f"{', '.join(valid) or 'none'}", attr.line, attr.column)
        self.seen[name] = e
        nested: list[Import] = []
        for kid in e.children:
            if isinstance(kid, Text):
                if kid.text.strip():
                    raise PMLError(f"text inside import <{name}>: it holds only imports of its "
                                   "nested modules", *_first_char(kid))
            else:
                nested.append(self.load(kid, name))
        args = tuple((a.name, a.value) for a in e.attrs.values())
        return Import(name, args, tuple(nested), e.line, e.column)
