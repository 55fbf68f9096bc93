"""A BERT encoder for embedders: transformers' `BertModel` in eval mode, last hidden states only, built
from a directory's config.json and model.safetensors without importing transformers.

Why: `AutoModel.from_pretrained` imports `transformers.modeling_utils`, which imports torch's distributed
tensors, dynamo, sympy and quantisation integrations; loading the embedder paid that import (as the
default generation model did before model/llama.py). The module tree carries `BertModel`'s parameter
names and its math (absolute positions, erf GELU, padded keys masked, the same
`scaled_dot_product_attention` call), so the states are transformers' own to float rounding
(tests/test_bert.py compares them).

Not here: anything a config asks for beyond that plain shape (relative positions, another activation, a
decoder, cross-attention, pruned heads, quantised or non-float32 weights, sharded or prefixed
checkpoints), the pooler, dropout, training, key/value caches. `BertEncoder.for_directory` returns None for
such a directory and the caller loads it with transformers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rag_promptcache.model import assigned

WEIGHTS = "model.safetensors"
# transformers' BertConfig defaults, for keys a config.json leaves out
_DEFAULTS = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12}
_IGNORED = ("pooler.", "embeddings.position_ids")  # the pooler, and a buffer older checkpoints saved


@dataclass(frozen=True, slots=True)
class BertConfig:
    """The fields of transformers' BertConfig the encoder reads (named as there: callers read
    `model.config.hidden_size` of either model)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def read(cls, directory: str | Path) -> BertConfig | None:
        """The directory's config when the encoder runs it as transformers would; else None."""
        try:
            raw = json.loads((Path(directory) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(raw, dict) or not _plain(raw):
            return None
        values = {**_DEFAULTS, **{k: raw[k] for k in _DEFAULTS if k in raw}}
        if not all(type(values[k]) is int and values[k] > 0 for k in _DEFAULTS if k != "layer_norm_eps"):
            return None
        if not isinstance(values["layer_norm_eps"], (int, float)) or values["hidden_size"] % values["num_attention_heads"]:
            return None
        return cls(**values)


def _plain(raw: dict) -> bool:
    """model_type bert, absolute positions, erf GELU, an encoder, float32, nothing pruned or quantised."""
    return (raw.get("model_type") == "bert" and raw.get("position_embedding_type", "absolute") == "absolute"
            and raw.get("hidden_act", "gelu") == "gelu" and not raw.get("is_decoder")
            and not raw.get("add_cross_attention") and not raw.get("pruned_heads")
            and "quantization_config" not in raw
            and all(raw.get(key) in (None, "float32") for key in ("dtype", "torch_dtype")))


class _AddNorm(nn.Module):
    """BertSelfOutput and BertOutput: a projection, then LayerNorm over it plus the residual."""

    def __init__(self, n_in: int, n_out: int, eps: float) -> None:
        super().__init__()
        self.dense = assigned.Linear(n_in, n_out)
        self.LayerNorm = assigned.LayerNorm(n_out, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _Projections(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query, self.key, self.value = (assigned.Linear(hidden, hidden) for _ in range(3))


class _Attention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = _Projections(config.hidden_size)
        self.output = _AddNorm(config.hidden_size, config.hidden_size, config.layer_norm_eps)
        self.num_heads = config.num_attention_heads

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, H = x.shape
        head_dim = H // self.num_heads
        q, k, v = (p(x).view(B, T, -1, head_dim).transpose(1, 2) for p in (self.self.query, self.self.key, self.self.value))
        # q, k, v: [B, heads, T, head_dim]; mask: [B, 1, 1, T], True where a key is a real token
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=head_dim ** -0.5)
        return self.output(out.transpose(1, 2).reshape(B, T, H), x)


class _Dense(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.dense = assigned.Linear(n_in, n_out)


class _Layer(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Dense(config.hidden_size, config.intermediate_size)
        self.output = _AddNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(F.gelu(self.intermediate.dense(x)), x)


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = assigned.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = assigned.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = assigned.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = assigned.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # summed in transformers' order: (words + token types) + positions
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x + self.position_embeddings(positions))


class _Layers(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class BertEncoder(nn.Module):
    """`BertModel`'s embeddings and encoder under its parameter names; `forward` returns the last hidden
    states [B, T, H]. Build it with `for_directory`."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Layers(config)

    @classmethod
    def for_directory(cls, directory: str | Path, device: str | torch.device = "cpu") -> BertEncoder | None:
        """The directory's BERT with its weights, in eval mode without grads; None when the directory is
        not one this module runs as transformers would (see the module docstring)."""
        config = BertConfig.read(directory)
        path = Path(directory) / WEIGHTS
        if config is None or not path.is_file():
            return None
        model = cls(config)
        state = _read_weights(path, {k: tuple(v.shape) for k, v in model.state_dict().items()})
        if state is None:
            return None
        model.load_state_dict(state, assign=True)  # the tensors read, not copies of them
        return model.to(device).eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embeddings.word_embeddings.weight.device

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids, attention_mask, token_type_ids: [B, T]
        x = self.embeddings(input_ids, torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids)
        # transformers passes no mask when nothing is padded, and so picks the same attention kernel
        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x  # [B, T, H]


def _read_weights(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor] | None:
    """The checkpoint's tensors for `shapes`' names (safetensors maps the file); None when a name is
    missing or extra, or a tensor has another shape or is not float32."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        if (f.metadata() or {}).get("format", "pt") != "pt":
            return None
        names = {k for k in f.keys() if not k.startswith(_IGNORED)}
        if names != set(shapes):
            return None
        for name in names:
            piece = f.get_slice(name)
            if piece.get_dtype() != "F32" or tuple(piece.get_shape()) != shapes[name]:
                return None
        return {name: f.get_tensor(name) for name in names}
