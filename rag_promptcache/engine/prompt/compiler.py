"""PML → tokens: compile a schema into cacheable units, and a prompt into ordered pieces with positions.

A *unit* is what gets one `ModuleKV`: a named module's own tokens (nested modules excluded, parameter
placeholders included), or the schema's root, which holds all anonymous text and the chat-template
markup of schema-level role tags. Each unit is encoded at its *encoding position*: where it would sit
in the smallest prompt that contains it (its ancestors' tokens before it, no siblings).

A prompt becomes a tuple of `Piece`s in sequence order. A piece is either a slice of a unit (served
from the store, relocated) or new tokens (computed in the request). The rules are in
docs/ARCHITECTURE.md ("How a prompt is compiled"). This module does not touch tensors or stores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from rag_promptcache.pml import ast
from rag_promptcache.pml.errors import PMLError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rag_promptcache.model.chat import RoleMarkup

ROOT = "@root"
Layout = Literal["contiguous", "schema"]
LAYOUTS: tuple[str, ...] = ("contiguous", "schema")


@dataclass(frozen=True, slots=True)
class Seg:
    """One stretch of a unit's content: own text, a parameter placeholder, or a slot for child modules."""

    kind: Literal["text", "param", "slot"]
    offset: int  # into the unit's own token_ids
    length: int  # tokens; 0 for a slot
    name: str = ""  # the parameter's name
    schema_pos: int = 0  # absolute schema position of this seg's first token (paper layout)


@dataclass(frozen=True, slots=True)
class Unit:
    name: str
    token_ids: tuple[int, ...]
    segs: tuple[Seg, ...]
    encode_start: int  # position of token 0 when encoded
    context_ids: tuple[int, ...]  # tokens before it in its smallest prompt (used by shared-prefix encoding)
    slot: tuple[str, int] = ("", -1)  # (parent unit, index of the slot seg in it) where this unit goes
    # the schema's neighbours of this module (`ast.Schema.neighbours`), their tokens in order: encoded
    # between its context and it, their KV dropped, its keys moved back to `encode_start`
    neighbour_ids: tuple[int, ...] = ()
    neighbour_names: tuple[str, ...] = ()  # the modules `neighbour_ids` are the tokens of
    neighbours_present: int = 0  # `ast.Schema.neighbours_present`: see `read_as`
    # kept from the prefills that compute it (`ast.Schema.byproduct`): its own store key, so a schema that
    # encodes its modules on their own never reads such an entry
    byproduct: bool = False


def read_as(unit: Unit, present: set[str]) -> Unit:
    """`unit` as a prompt whose cached modules are `present` reads it: its KV encoded after its neighbours
    where at least `neighbours_present` of them are there (or that is 0), else its plain KV."""
    if not unit.neighbour_names or len(present.intersection(unit.neighbour_names)) >= unit.neighbours_present:
        return unit
    return plain(unit)


def plain(unit: Unit) -> Unit:
    """`unit` encoded without its neighbours: the entry a schema without them stores."""
    return replace(unit, neighbour_ids=(), neighbour_names=(), neighbours_present=0)


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of tokens in sequence order, at positions position .. position + len - 1."""

    token_ids: tuple[int, ...]
    position: int
    unit: str | None = None  # None: new tokens, computed in the request
    offset: int = 0  # where in the unit's token_ids the run starts

    @property
    def cached(self) -> bool:
        return self.unit is not None


@dataclass(frozen=True, slots=True)
class CompiledSchema:
    name: str
    units: dict[str, Unit]
    size: int  # schema positions used (paper layout)


class Compiler:
    """Tokenizes schemas (once, lazily per module) and compiles prompts against them."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, markup: RoleMarkup,
                 wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> None:
        """`wrap`: token ids every module opens and closes with (a model's trained wrapper tokens,
        model/links.py), part of the module's own tokens; none by default."""
        self.tokenizer = tokenizer
        self.markup = markup
        self.wrap = wrap
        ids = tokenizer("a")["input_ids"]
        bos = tokenizer.bos_token_id
        self.bos: tuple[int, ...] = (bos,) if bos is not None and ids and ids[0] == bos else ()
        space = tokenizer(" ", add_special_tokens=False)["input_ids"]
        self.filler = space[0] if len(space) == 1 else (tokenizer.eos_token_id or 0)
        self._memo: dict[str, tuple[int, ...]] = {}

    def tokenize(self, text: str) -> tuple[int, ...]:
        if not text:
            return ()
        ids = self._memo.get(text)
        if ids is None:
            ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            if len(self._memo) < 200_000:  # schema texts recur on every recompile; prompts rarely do
                self._memo[text] = ids
        return ids

    def tokenize_before_word(self, text: str) -> tuple[int, ...]:
        """`text` as the tokenizer splits it when a word follows: the text before a slot of modules.

        A module is tokenized on its own, but `apply_chat_template` tokenizes the whole conversation,
        and byte-level BPE splits a run of newlines differently at the end of a string ("\n\n" is one
        token) than before a word ("\n", "\n"): the corpus schema's instructions end so. Tokenizing
        the text with a word after it and dropping that word's token gives the whole-string split;
        where the word would merge with the text (a trailing space joins it), the text is kept as is.
        """
        ids = self.tokenize(text)
        if not text or not text[-1].isspace():
            return ids
        word = self.tokenize("x")
        joined = self.tokenize(text + "x")
        if len(word) == 1 and joined[-1:] == word and self.tokenizer.decode(joined[:-1]) == self.tokenizer.decode(ids):
            return joined[:-1]
        return ids

    # -- schema ----------------------------------------------------------------------------------

    def compile_schema(self, schema: ast.Schema, chat: bool, default_system: bool = False) -> CompiledSchema:
        """`chat`: the sequence is a conversation, opened by the template's prefix (which holds BOS
        if the template writes it) and, with `default_system`, by the system turn the template injects
        when the first message is not a system message. Chat text gets no BOS from the tokenizer:
        `apply_chat_template(..., tokenize=True)` adds none, so a tokenizer whose post-processor adds
        BOS and a template that writes it give one BOS, not two. Plain text gets the tokenizer's BOS."""
        units: dict[str, Unit] = {}
        lead = self.markup.prefix + (self.markup.default_system if default_system else "") if chat else ""
        size = self._unit(ROOT, schema.children, lead, () if chat else self.bos, 0, (), 0, ("", -1), units)
        for name, names in schema.neighbours.items():
            bad = [n for n in (name, *names) if n not in units or n == ROOT] + [n for n in names if n == name]
            if bad:
                known = ", ".join(n for n in units if n != ROOT) or "none"
                raise ValueError(f"schema {schema.name!r}: neighbours of {name!r} name {bad[0]!r}, which is not "
                                 f"another module of the schema; valid: {known}")
            ids = tuple(t for n in names for t in units[n].token_ids)
            units[name] = replace(units[name], neighbour_ids=ids, neighbour_names=tuple(names),
                                  neighbours_present=schema.neighbours_present)
        if schema.byproduct:
            if schema.neighbours:
                raise ValueError(f"schema {schema.name!r}: modules kept from prefills (byproduct) are not also "
                                 "encoded after neighbours; choose one")
            units.update((n, replace(u, byproduct=True)) for n, u in units.items() if n != ROOT)
        return CompiledSchema(schema.name, units, size)

    def _unit(
        self,
        name: str,
        children: tuple[ast.Node, ...],
        lead: str,
        lead_ids: tuple[int, ...],
        encode_start: int,
        context: tuple[int, ...],
        schema_start: int,
        slot: tuple[str, int],
        units: dict[str, Unit],
    ) -> int:
        """Compile one unit and, recursively, its children. Returns its full size in schema positions."""
        flat = _flatten(children, self.markup, lead, structural=name == ROOT)
        opening, closing = self.wrap if name != ROOT else ((), ())
        lead_ids = lead_ids + opening
        token_ids: list[int] = list(lead_ids)
        segs: list[Seg] = []
        pos = schema_start
        if lead_ids:
            segs.append(Seg("text", 0, len(lead_ids), schema_pos=pos))
            pos += len(lead_ids)
        for i, item in enumerate(flat):
            if isinstance(item, str):
                before_slot = i + 1 < len(flat) and isinstance(flat[i + 1], list)
                ids = self.tokenize_before_word(item) if before_slot else self.tokenize(item)
                if ids:
                    segs.append(Seg("text", len(token_ids), len(ids), schema_pos=pos))
                    token_ids.extend(ids)
                    pos += len(ids)
            elif isinstance(item, ast.Param):
                segs.append(Seg("param", len(token_ids), item.length, item.name, schema_pos=pos))
                token_ids.extend([self.filler] * item.length)
                pos += item.length
            else:  # a run of sibling modules and unions
                offset = len(token_ids)
                child_context = context + tuple(token_ids)
                slot_pos = pos
                for node in item:
                    members = node.modules if isinstance(node, ast.Union) else (node,)
                    widest = 0
                    for m in members:
                        widest = max(
                            widest,
                            self._unit(m.name, m.children, "", (), encode_start + offset, child_context, pos,
                                       (name, len(segs)), units),
                        )
                    pos += widest
                segs.append(Seg("slot", offset, 0, schema_pos=slot_pos))
        if closing:
            segs.append(Seg("text", len(token_ids), len(closing), schema_pos=pos))
            token_ids.extend(closing)
            pos += len(closing)
        units[name] = Unit(name, tuple(token_ids), tuple(segs), encode_start, context, slot)
        return pos - schema_start

    # -- prompt ----------------------------------------------------------------------------------

    def compile_prompt(self, compiled: CompiledSchema, prompt: ast.Prompt, layout: Layout = "contiguous") -> list[Piece]:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
        pieces: list[Piece] = []
        imports = [c for c in prompt.children if isinstance(c, ast.Import)]
        own = [i for i, c in enumerate(prompt.children) if isinstance(c, ast.Role) or
               (isinstance(c, ast.Text) and c.text.strip())]
        late = [c for c in prompt.children[own[0]:] if isinstance(c, ast.Import)] if own else []
        if late:
            raise PMLError(f"import of {late[0].name!r} follows the prompt's own text; imports come first "
                           "(put fixed text in the schema)", late[0].line, late[0].column)
        for imp in imports:
            if imp.name not in compiled.units:  # a Prompt record built in Python skips the parser's check
                where = f"schema {compiled.name!r}" if compiled.name else 'a prompt without a schema (write <prompt schema="...">)'
                known = ", ".join(n for n in compiled.units if n != ROOT) or "none"
                raise PMLError(f"unknown module {imp.name!r} in {where}; valid: {known}", imp.line, imp.column)
        cursor = self._emit(compiled, compiled.units[ROOT], None, imports, layout, 0, pieces)
        if layout == "schema":
            cursor = max(compiled.size, cursor)
        text = _render_prompt_tail(prompt.children, self.markup)
        ids = self.tokenize(text)
        if ids:
            pieces.append(Piece(ids, cursor))
        return pieces

    def _emit(
        self,
        compiled: CompiledSchema,
        unit: Unit,
        imp: ast.Import | None,
        child_imports: list[ast.Import],
        layout: Layout,
        cursor: int,
        out: list[Piece],
    ) -> int:
        args = dict(imp.args) if imp is not None else {}
        for index, seg in enumerate(unit.segs):
            pos = cursor if layout == "contiguous" else seg.schema_pos
            if seg.kind == "text":
                ids = unit.token_ids[seg.offset : seg.offset + seg.length]
                out.append(Piece(ids, pos, unit.name, seg.offset))
                cursor = pos + seg.length
            elif seg.kind == "param":
                if seg.name not in args:
                    assert imp is not None, f"{seg=}"  # params live in modules, and a module is imported
                    raise PMLError(
                        f"module {unit.name!r} needs its parameter {seg.name!r} (a value of at most {seg.length} "
                        f"tokens): write <{unit.name} {seg.name}=\"...\"/> (an empty value is allowed)",
                        imp.line, imp.column)
                value = args[seg.name]
                ids = self.tokenize(value)
                if len(ids) > seg.length:
                    assert imp is not None, f"{seg=}"
                    raise PMLError(
                        f"value of parameter {seg.name!r} of module {unit.name!r} is {len(ids)} tokens; "
                        f"its len is {seg.length}", imp.line, imp.column)
                if ids:
                    out.append(Piece(ids, pos))
                cursor = pos + (len(ids) if layout == "contiguous" else seg.length)
            else:
                here = [c for c in child_imports if compiled.units[c.name].slot == (unit.name, index)]
                for child in here:
                    cursor = self._emit(compiled, compiled.units[child.name], child, list(child.children),
                                        layout, cursor, out)
                if layout == "schema":
                    cursor = max(cursor, seg.schema_pos)
        return cursor


def _flatten(
    children: tuple[ast.Node, ...], markup: RoleMarkup, lead: str, structural: bool
) -> list[str | ast.Param | list[ast.Node]]:
    """Children → merged text strings, params, and runs of sibling modules/unions.

    Role tags become template text. Whitespace-only text between modules is formatting and is dropped;
    text inside a module is kept verbatim.
    """
    out: list[str | ast.Param | list[ast.Node]] = [lead] if lead else []

    def add_text(s: str) -> None:
        if out and isinstance(out[-1], str):
            out[-1] += s
        else:
            out.append(s)

    def walk(nodes: tuple[ast.Node, ...], structural: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.Text):
                if structural and not node.text.strip():
                    continue
                add_text(node.text)
            elif isinstance(node, ast.Param):
                out.append(node)
            elif isinstance(node, ast.Role):
                add_text(markup.open[node.role])
                walk(node.children, structural=True)
                add_text(markup.close[node.role])
            else:  # Module or Union
                if out and isinstance(out[-1], list):
                    out[-1].append(node)
                else:
                    out.append([node])

    walk(children, structural)
    return out


def _render_prompt_tail(children: tuple[ast.PromptNode, ...], markup: RoleMarkup) -> str:
    parts: list[str] = []
    last_role = None
    own = [c for c in children if not isinstance(c, ast.Import)]
    for c in own:
        if isinstance(c, ast.Text):
            text = c.text
            # whitespace around a prompt's top-level text is layout, like the indentation of PML source
            if not text.strip():
                continue
            parts.append(text.strip())
            last_role = None
        else:
            body = "".join(t.text for t in c.children if isinstance(t, ast.Text))
            parts.append(markup.open[c.role] + body + markup.close[c.role])
            last_role = c.role
    if last_role == "user":
        parts.append(markup.generation_prompt)
    return "".join(parts)
