"""The rotary position embedding applied to queries and keys, as transformers' Llama applies it (rotate_half
layout), here so that our Llama (model/llama.py), the lean forward and the batch step do not import transformers'
model code for it (its import pulls transformers' model loading: seconds of a command's start-up).
tests/test_forward.py holds it equal to transformers' own."""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, H, N, D]; cos, sin: [B, N, D] → q and k rotated."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
