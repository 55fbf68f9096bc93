"""torch layers whose weights a loader assigns from a checkpoint (`load_state_dict(assign=True)`), not
initialised first: random values for SmolLM2's 135M parameters cost about 0.5 s, and made on the meta
device instead, torch imports its reference ops (sympy, dynamo) first, 1.4 s. Our Llama and BERT
(model/llama.py, model/bert.py) are built from them; they compute what torch's own layers compute."""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        pass  # the checkpoint's weights replace these


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        pass


class LayerNorm(nn.LayerNorm):
    def reset_parameters(self) -> None:
        pass
