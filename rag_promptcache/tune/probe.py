"""Greedy answers under the engine's layout without the engine: a batch of laid-out prompts read
with the block mask (recovery `none`) or the causal mask (full prefill), left-padded, on any device.

For measuring a tuned adapter where the engine's native CPU path does not run (a GPU) and for
many prompts at once; `rag-promptcache bench --scenarios fidelity` stays the measure that counts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rag_promptcache.engine.compute.runner import cache_arg, output_cache
from rag_promptcache.tune.layout import Laid, batch_masks


@torch.no_grad()
def greedy(model, prompts: Sequence[Laid], *, full: bool, max_new_tokens: int, eos_ids: Sequence[int],
           batch: int = 16) -> list[list[int]]:
    """Each prompt's greedy answer tokens (its tokens up to `answer_from`), EOS excluded."""
    device = next(model.parameters()).device
    out: list[list[int]] = []
    order = sorted(range(len(prompts)), key=lambda i: prompts[i].answer_from)
    answers: dict[int, list[int]] = {}
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        group = [prompts[i] for i in idx]
        lengths = [p.answer_from for p in group]
        ids, pos, mask = batch_masks(group, [full] * len(group), device, lengths=lengths, left=True)
        width = ids.shape[1]
        # what a new token reads: the prompt without hidden copies (`Laid.hidden`; a causal read has none)
        valid = torch.tensor([[j >= width - n and not (p.hidden and not full and p.hidden[j - width + n])
                               for j in range(width)] for p, n in zip(group, lengths)], device=device)
        res = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True)
        cache = output_cache(res)
        nxt = res.logits[:, -1].argmax(-1)
        done = torch.zeros(len(group), dtype=torch.bool, device=device)
        eos = torch.tensor(list(eos_ids), device=device)
        tokens: list[torch.Tensor] = []
        step_pos = torch.tensor([p.positions()[n - 1] + 1 for p, n in zip(group, lengths)], device=device)
        for _ in range(max_new_tokens):
            tokens.append(nxt)
            done |= torch.isin(nxt, eos)
            if bool(done.all()):
                break
            valid = torch.cat([valid, torch.ones(len(group), 1, dtype=torch.bool, device=device)], 1)
            res = model(input_ids=nxt[:, None], position_ids=step_pos[:, None], attention_mask=valid[:, None, None, :],
                        use_cache=True, **cache_arg(model, cache))
            cache = output_cache(res)
            step_pos = step_pos + 1
            nxt = res.logits[:, -1].argmax(-1)
        rows = torch.stack(tokens, 1).tolist()
        for i, row in zip(idx, rows):
            cut = next((j for j, t in enumerate(row) if t in set(eos_ids)), len(row))
            answers[i] = row[:cut]
    out = [answers[i] for i in range(len(prompts))]
    return out
