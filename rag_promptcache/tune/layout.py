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

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rag_promptcache.engine.planning.recovery import with_links
from rag_promptcache.engine.prompt.compiler import Compiler
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
    earlier tokens; a new token sees everything before it. `loss_from`: the first token whose
    next-token prediction is trained (the question's first token); `answer_from`: the answer's first."""

    ids: list[int]
    unit: list[int]
    context: list[int]
    loss_from: int
    answer_from: int
    num_links: int = 0  # learned tokens (links, wrappers: model/links.py), all before `loss_from`
    first_link: int = 0  # the first learned token's id; ids from it on are learned

    def __len__(self) -> int:
        return len(self.ids)

    def plain(self) -> Laid:
        """The same sample without its link tokens: the prompt a full prefill reads."""
        if not self.num_links:
            return self
        keep = [i for i, t in enumerate(self.ids) if t < self.first_link]
        return Laid([self.ids[i] for i in keep], [self.unit[i] for i in keep], [self.context[i] for i in keep],
                    self.loss_from - self.num_links, self.answer_from - self.num_links)


class Layouter:
    """Lays out (instructions, module texts, question, answer) as the engine would for a corpus prompt;
    with `link_ids`, those link tokens after each module, as recovery `links:N` places them."""

    def __init__(self, tokenizer, mode: str = "shared_prefix", link_ids: Sequence[int] = (),
                 wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> None:
        """`wrap`: wrapper token ids every module opens and closes with (the engine's compiler places
        them so for a model trained with them)."""
        if mode not in MODES:
            raise ValueError(f"unknown encoding mode {mode!r}; valid: {', '.join(MODES)}")
        self.tokenizer = tokenizer
        self.mode = mode
        self.schemas = Schemas(Compiler(tokenizer, role_markup(tokenizer), wrap), "tune", mode)
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else tokenizer.eos_token_id
        self.link_ids = tuple(link_ids)
        self.wrap_ids = (*wrap[0], *wrap[1])

    def lay(self, instructions: str, modules: Sequence[str], question: str, answer: str) -> Laid:
        names = [f"m{i}" for i in range(len(modules))]
        mods = {n: ast.Module(n, (ast.Text(t),)) for n, t in zip(names, modules)}
        system = ast.Role("system", (ast.Text(instructions + "\n\n"), *mods.values()))
        self.schemas.add(ast.Schema(SCHEMA, (system,), modules=mods, parents={n: None for n in names}, union_of={}),
                         replace=True)
        out = self.schemas.compile_prompt(prompt_pml(SCHEMA, names, [("user", question)]))
        ids: list[int] = []
        unit: list[int] = []
        context: list[int] = []
        numbers = {n: i for i, n in enumerate(out.schema.units)}
        for p in with_links(out.pieces, self.link_ids):
            assert p.position == len(ids), f"{p.position=} {len(ids)=}: the layout is contiguous"
            u = out.schema.units[p.unit] if p.cached else None
            ctx = len(u.context_ids) if u is not None and self.mode == "shared_prefix" else 0
            if ctx:
                assert tuple(ids[:ctx]) == u.context_ids, "a shared-prefix unit's context opens the sequence"
            ids.extend(p.token_ids)
            unit.extend([numbers[p.unit] if p.cached else -1] * len(p.token_ids))
            context.extend([ctx] * len(p.token_ids))
        learned = set(self.link_ids) | set(self.wrap_ids)  # a full prefill reads none of them (`Laid.plain`)
        num_links = sum(1 for t in ids if t in learned)
        first_new = next(i for i, (u, t) in enumerate(zip(unit, ids)) if u == -1 and t not in learned)
        answer_ids = self.tokenizer.encode(answer, add_special_tokens=False) + [self.eos]
        answer_from = len(ids)
        ids.extend(answer_ids)
        unit.extend([-1] * len(answer_ids))
        context.extend([0] * len(answer_ids))
        return Laid(ids, unit, context, first_new, answer_from, num_links, min(learned, default=0))


def block_mask(laid: Laid, device: torch.device | str = "cpu") -> torch.Tensor:
    """[S, S] bool, True where token i may attend to token j: the engine's attention with recovery `none`."""
    unit = torch.tensor(laid.unit, device=device)
    ctx = torch.tensor(laid.context, device=device)
    n = len(laid.unit)
    j = torch.arange(n, device=device)
    causal = j[None, :] <= j[:, None]
    sees = (unit[:, None] == -1) | (unit[:, None] == unit[None, :]) | (j[None, :] < ctx[:, None])
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
        pos[b, at] = torch.arange(n, device=device)
        mask[b, 0, at, at] = (torch.ones(n, n, dtype=torch.bool, device=device).tril() if full[b]
                              else block_mask(s, device)[:n, :n])
    return ids, pos, mask
