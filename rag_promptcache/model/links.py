"""Link tokens (KVLink, Yang et al. 2025): a few learned embeddings placed after each cached module;
and wrapper tokens (KV Packet, Chen et al. 2026): learned embeddings placed around every module.

A link token is an ordinary new token of the prompt whose embedding is learned. Its id lies past the
model's vocabulary (`first_id = vocab_size`, then `first_id + 1`, ...), so the tokenizer never makes
one and the head never predicts one: the model's token embedding is wrapped (`LinkEmbedding`) to look
those ids up in a small table of their own, and the tied head keeps the vocabulary's rows only.

The engine computes links with the question in the one prefill (`links:N` recovery,
engine/planning/recovery.py): each sees the cached modules before it and the links before it, so it
carries what those modules would have seen of each other. A tuned adapter saves the table beside its
LoRA (`links.safetensors`, model/adapter.py) and `merge` installs it.

Wrapper tokens are rows of the same table, before the links: W opening and W closing rows (`wrap_ids`),
which the prompt compiler puts before and after every module's own tokens (engine/prompt/compiler.py).
They are part of the module, so they are encoded with it when it is stored and cost nothing when a
question reads it; the table's `wrap` (saved in the file's metadata) says how many there are.

Out of scope: training them (tune/train.py), placing them in a prompt (the recovery, the compiler).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

FILE = "links.safetensors"
KEY = "links"


class LinkEmbedding(nn.Module):
    """The model's token embedding, with learned rows for the ids from `first_id` on: 2 x `wrap` wrapper
    rows (opening, then closing), then `num_links` link rows."""

    def __init__(self, base: nn.Module, links: torch.Tensor, wrap: int = 0) -> None:
        super().__init__()
        self.base = base
        self.first_id = int(base.weight.shape[0])
        self.links = nn.Parameter(links.to(base.weight.dtype), requires_grad=False)
        self.wrap = wrap

    @property
    def weight(self) -> torch.Tensor:
        """The vocabulary's rows (what a tied head reads), not the links."""
        return self.base.weight

    @property
    def num_rows(self) -> int:
        return int(self.links.shape[0])

    @property
    def num_links(self) -> int:
        """Link rows: the table's rows after the wrappers'."""
        return self.num_rows - 2 * self.wrap

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        is_link = ids >= self.first_id
        out = self.base(ids.clamp(max=self.first_id - 1))  # [..., E]
        if not bool(is_link.any()):
            return out
        rows = self.links[(ids - self.first_id).clamp(0, self.num_rows - 1)].to(out.dtype)  # [..., E]
        return torch.where(is_link.unsqueeze(-1), rows, out)


def install(model: nn.Module, links: torch.Tensor, wrap: int = 0) -> LinkEmbedding:
    """Wrap `model`'s input embedding with learned rows `links` [N, hidden], the first 2 x `wrap` of them
    wrapper rows (replacing earlier ones)."""
    current = model.get_input_embeddings()
    base = current.base if isinstance(current, LinkEmbedding) else current
    hidden = base.weight.shape[1]
    if links.dim() != 2 or links.shape[1] != hidden or links.shape[0] < 1:
        raise ValueError(f"link embeddings must be [N >= 1, {hidden}] for this model, got {list(links.shape)}")
    if wrap < 0 or 2 * wrap > links.shape[0]:
        raise ValueError(f"{wrap} wrapper tokens a side need {2 * wrap} rows; the table has {links.shape[0]}")
    wrapped = LinkEmbedding(base, links.to(base.weight.device), wrap)
    model.set_input_embeddings(wrapped)
    return wrapped


def fresh(model: nn.Module, num: int, seed: int = 0) -> torch.Tensor:
    """`num` new link rows [num, hidden] in fp32: the vocabulary's mean embedding plus noise of its spread."""
    if num < 1:
        raise ValueError(f"the number of link tokens must be >= 1, got {num}")
    emb = model.get_input_embeddings()
    weight = (emb.base if isinstance(emb, LinkEmbedding) else emb).weight.detach().float()
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(num, weight.shape[1], generator=gen) * weight.std(0).cpu()
    return weight.mean(0).cpu() + noise


def of(model: nn.Module) -> LinkEmbedding | None:
    """The model's link embedding, or None when it has no trained links."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return emb if isinstance(emb, LinkEmbedding) else None


def ids(model: nn.Module, num: int) -> tuple[int, ...]:
    """The ids of the first `num` link tokens of `model`; ValueError where it has fewer (or none)."""
    emb = of(model)
    have = 0 if emb is None else emb.num_links
    if num > have:
        what = "no trained link tokens" if have == 0 else f"only {have} trained link tokens"
        raise ValueError(f"links:{num} needs an adapter trained with link tokens; this model has {what} "
                         "(load an adapter with links.safetensors, or use last:N or none)")
    assert emb is not None, f"{num=}"
    first = emb.first_id + 2 * emb.wrap
    return tuple(range(first, first + num))


def wrap_ids(model: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids of the wrapper tokens every module opens and closes with: ((), ()) where there are none."""
    emb = of(model)
    if emb is None or not emb.wrap:
        return (), ()
    first, w = emb.first_id, emb.wrap
    return tuple(range(first, first + w)), tuple(range(first + w, first + 2 * w))


def save(links: torch.Tensor, directory: str | Path, wrap: int = 0) -> None:
    from safetensors.torch import save_file

    save_file({KEY: links.detach().to(torch.float32).cpu().contiguous()}, str(Path(directory) / FILE),
              metadata={"wrap": str(wrap)})


def wrap_of(directory: str | Path) -> int:
    """How many wrapper tokens a side the table saved in `directory` holds (0: none, or no table)."""
    path = Path(directory) / FILE
    if not path.is_file():
        return 0
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return int((f.metadata() or {}).get("wrap", "0"))


def load(directory: str | Path) -> torch.Tensor | None:
    """The link rows saved in `directory`, or None when it has none."""
    path = Path(directory) / FILE
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))[KEY]
