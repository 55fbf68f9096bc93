"""Training samples laid out as the engine runs them: token ids, positions, and the attention mask of
modules encoded on their own.

The engine compiles a prompt into pieces (engine/prompt/schemas.py `Schemas.compile_prompt`, the same call
`Planner.plan` makes). A cached piece's KV was encoded with its unit's context only: in
`shared_prefix` mode the schema's shared prefix (the system turn's opening) and the unit's own
tokens, in `isolated` mode its own tokens alone; the new tokens (the question, its chat markup, the
answer) see everything before them. With RoPE, a module encoded on its own and relocated equals the
same tokens computed at their final positions under that mask, so a model trained under the mask
learns to read exactly the KV the engine assembles with recovery `none`.

Not here: where samples come from (`samples.py`) or the loop (`train.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rag_promptcache.engine.planning.recovery import with_links
from rag_promptcache.engine.prompt.compiler import Compiler, read_as
from rag_promptcache.engine.prompt.schemas import Schemas
from rag_promptcache.model.chat import role_markup
from rag_promptcache.pml import ast
from rag_promptcache.pml.build import prompt_pml

MODES: tuple[str, ...] = ("shared_prefix", "isolated")
SCHEMA = "tune"


@dataclass(frozen=True, slots=True)
class Laid:
    """One sample in the engine's layout. `unit[i]` numbers the cached unit token i comes from (-1: a
    new token); a cached token sees the first `context[i]` tokens of the sequence and its own unit's
    earlier tokens; a new token sees everything before it but hidden tokens. `loss_from`: the first token
    whose next-token prediction is trained (the question's first token); `answer_from`: the answer's first.

    A module encoded after its neighbours (`Layouter.lay(neighbours=...)`) is preceded by a hidden copy of
    what its encoding read first (the shared prefix, then the neighbours' tokens), in its unit, at the
    positions that put the module at its own: the distances its encoding saw (engine/planning/encoder.py).
    `pos`: each token's position (None: 0, 1, ...); `hidden[i]`: token i is such a copy (None: none is)."""

    ids: list[int]
    unit: list[int]
    context: list[int]
    loss_from: int
    answer_from: int
    num_links: int = 0  # learned tokens (links, wrappers: model/links.py), all before `loss_from`
    first_link: int = 0  # the first learned token's id; ids from it on are learned
    pos: list[int] | None = None
    hidden: list[bool] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def positions(self) -> list[int]:
        return list(range(len(self.ids))) if self.pos is None else self.pos

    def plain(self) -> Laid:
        """The same sample without its link tokens and hidden copies: the prompt a full prefill reads."""
        if not self.num_links and self.hidden is None:
            return self
        hidden = self.hidden or [False] * len(self.ids)
        keep = [i for i, t in enumerate(self.ids) if not hidden[i] and not (self.num_links and t >= self.first_link)]
        return Laid([self.ids[i] for i in keep], [self.unit[i] for i in keep], [self.context[i] for i in keep],
                    sum(i < self.loss_from for i in keep), sum(i < self.answer_from for i in keep))


@dataclass(frozen=True, slots=True)
class Neighbourhood:
    """What a corpus ingested with `--neighbours M` encodes each module after: its neighbours' texts, by the
    module's text, and how many of them a prompt must hold for the module to read that encoding
    (`--neighbours-present`; 0: always)."""

    of: Mapping[str, tuple[str, ...]]
    present: int = 0


class Layouter:
    """Lays out (instructions, module texts, question, answer) as the engine would for a corpus prompt;
    with `link_ids`, those link tokens after each module, as recovery `links:N` places them."""

    def __init__(self, tokenizer, mode: str = "shared_prefix", link_ids: Sequence[int] = (),
                 wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()), near: Neighbourhood | None = None) -> None:
        """`wrap`: wrapper token ids every module opens and closes with (the engine's compiler places
        them so for a model trained with them); `near`: a corpus's neighbour lists, for prompts `lay` is
        given none."""
        if mode not in MODES:
            raise ValueError(f"unknown encoding mode {mode!r}; valid: {', '.join(MODES)}")
        self.tokenizer = tokenizer
        self.mode = mode
        self.schemas = Schemas(Compiler(tokenizer, role_markup(tokenizer), wrap), "tune", mode)
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id
        self.link_ids = tuple(link_ids)
        self.wrap_ids = (*wrap[0], *wrap[1])
        self.near = near

    def lay(self, instructions: str, modules: Sequence[str], question: str, answer: str,
            neighbours: Sequence[Sequence[str]] = (), present: int = 0) -> Laid:
        """`neighbours[i]`: the texts module i is encoded after, least similar first (a corpus ingested with
        `--neighbours M`; default: the `near` the layouter was given); none: every module encoded on its own.
        A module reads them as the engine's plan does (`compiler.read_as`: where `present` of them, or
        `near.present`, are in the prompt; 0: always)."""
        if not neighbours and self.near is not None:
            neighbours, present = [self.near.of.get(t, ()) for t in modules], self.near.present
        names = [f"m{i}" for i in range(len(modules))]
        named = dict(zip(reversed(modules), reversed(names)))  # a neighbour in the prompt is that module
        extra: dict[str, str] = {}  # the others: text -> a module declared after the prompt's
        for t in (t for texts in neighbours for t in texts if t not in named):
            named[t] = extra.setdefault(t, f"n{len(extra)}")
        mods = {n: ast.Module(n, (ast.Text(t),)) for n, t in (*zip(names, modules), *((n, t) for t, n in extra.items()))}
        system = ast.Role("system", (ast.Text(instructions + "\n\n"), *mods.values()))
        near = {m: tuple(named[t] for t in texts) for m, texts in zip(names, neighbours) if texts}
        self.schemas.add(ast.Schema(SCHEMA, (system,), modules=mods, parents={n: None for n in mods}, union_of={},
                                    neighbours=near, neighbours_present=present), replace=True)
        out = self.schemas.compile_prompt(prompt_pml(SCHEMA, names, [("user", question)]))
        cached = {p.unit for p in out.pieces if p.cached}
        ids: list[int] = []
        unit: list[int] = []
        context: list[int] = []
        pos: list[int] = []
        hidden: list[bool] = []
        numbers = {n: i for i, n in enumerate(out.schema.units)}
        for p in with_links(out.pieces, self.link_ids):
            assert p.position == len(ids) - sum(hidden), f"{p.position=} {len(ids)=}: the layout is contiguous"
            u = read_as(out.schema.units[p.unit], cached) if p.cached else None
            ctx = len(u.context_ids) if u is not None and self.mode == "shared_prefix" else 0
            if ctx:
                assert tuple(ids[:ctx]) == u.context_ids, "a shared-prefix unit's context opens the sequence"
            if u is not None and u.neighbour_ids:  # it reads its own copy of the shared prefix, not the sequence's
                ctx = 0
            if u is not None and u.neighbour_ids and p.offset == 0:  # what its encoding read first, a copy of its own
                copy = (*(u.context_ids if self.mode == "shared_prefix" else ()), *u.neighbour_ids)
                ids.extend(copy)
                unit.extend([numbers[p.unit]] * len(copy))
                pos.extend(range(p.position - len(copy), p.position))
                hidden.extend([True] * len(copy))
                context.extend([0] * len(copy))
            ids.extend(p.token_ids)
            unit.extend([numbers[p.unit] if p.cached else -1] * len(p.token_ids))
            context.extend([ctx] * len(p.token_ids))
            pos.extend(range(p.position, p.position + len(p.token_ids)))
            hidden.extend([False] * len(p.token_ids))
        learned = set(self.link_ids) | set(self.wrap_ids)  # a full prefill reads none of them (`Laid.plain`)
        num_links = sum(1 for t in ids if t in learned)
        first_new = next(i for i, (u, t) in enumerate(zip(unit, ids)) if u == -1 and t not in learned)
        answer_ids = self.tokenizer.encode(answer, add_special_tokens=False) + [self.eos]
        answer_from = len(ids)
        ids.extend(answer_ids)
        unit.extend([-1] * len(answer_ids))
        context.extend([0] * len(answer_ids))
        if not any(hidden):
            return Laid(ids, unit, context, first_new, answer_from, num_links, min(learned, default=0))
        pos.extend(range(pos[-1] + 1, pos[-1] + 1 + len(answer_ids)))
        low = min(pos)  # a copy before the sequence's start: every position later by as much (RoPE reads distances)
        return Laid(ids, unit, context, first_new, answer_from, num_links, min(learned, default=0),
                    [q - low for q in pos] if low < 0 else pos, hidden + [False] * len(answer_ids))


def block_mask(laid: Laid, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, S] bool, True where token i may attend to token j: the engine's attention with recovery `none`."""
    unit = torch.tensor(laid.unit, device=device)
    ctx = torch.tensor(laid.context, device=device)
    n = len(laid.unit)
    j = torch.arange(n, device=device)
    causal = j[None, :] <= j[:, None]
    shown = torch.ones(n, dtype=torch.bool, device=device) if laid.hidden is None else ~torch.tensor(laid.hidden, device=device)
    sees = ((unit[:, None] == -1) & shown[None, :]) | (unit[:, None] == unit[None, :]) | (j[None, :] < ctx[:, None])
    return causal & sees


def batch_masks(samples: Sequence[Laid], full: Sequence[bool], device: torch.device | str = "cpu",
                lengths: Sequence[int] | None = None, left: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Padded (ids [B, S], positions [B, S], mask [B, 1, S, S] bool, True: may attend) for a batch;
    `full[b]`: sample b gets the plain causal mask (full prefill) instead of the block mask;
    `lengths[b]`: take only its first tokens (a prompt without its answer); `left`: pad on the left
    (for generation, so every row's last token is at the end)."""
    lengths = [len(s) for s in samples] if lengths is None else list(lengths)
    width = max(lengths)
    ids = torch.zeros(len(samples), width, dtype=torch.long, device=device)
    pos = torch.zeros(len(samples), width, dtype=torch.long, device=device)
    mask = torch.eye(width, dtype=torch.bool, device=device).repeat(len(samples), 1, 1, 1)  # padding sees itself
    for b, (s, n) in enumerate(zip(samples, lengths)):
        at = slice(width - n, width) if left else slice(0, n)
        ids[b, at] = torch.tensor(s.ids[:n], device=device)
        pos[b, at] = torch.tensor(s.positions()[:n], device=device)
        mask[b, 0, at, at] = (torch.ones(n, n, dtype=torch.bool, device=device).tril() if full[b]
                              else block_mask(s, device)[:n, :n])
    return ids, pos, mask
