"""A sentence-transformers model of the common shape run on transformers alone: a transformers encoder,
the mean of its token states over the attention mask, L2 normalisation. The default embedder,
all-MiniLM-L6-v2, is one.

Why: importing sentence-transformers imports scikit-learn and SciPy's statistics, which on a small CPU
takes about as long as loading the model it runs; every `ask` paid it. Run this way, the encoder,
tokenizer, truncation and pooling are the ones sentence-transformers uses for such a directory, and the
vectors are its vectors to float rounding (tests/test_embed_pooling.py compares them).
The encoder of a plain BERT directory (the default's) is our own (`model/bert.py`, transformers' math
under its parameter names): `AutoModel.from_pretrained` imports `transformers.modeling_utils`, which
imports torch's distributed tensors, dynamo and sympy, again about as long as loading the model (the
default generation model has its own Llama for the same reason: model/llama.py). Any other encoder loads
through `AutoModel`; the tokenizer is transformers' in both cases.

Not here: any other pipeline (CLS or max pooling, prompts, dense layers, tokenizer or model arguments,
hub names): `rag/embed.py` runs those through sentence-transformers itself.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# sentence-transformers' module types (by their last name) a directory may list, in this order
_PIPELINE = ("Transformer", "Pooling", "Normalize")
_MEAN_ONLY = {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False, "pooling_mode_max_tokens": False,
              "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
              "pooling_mode_lasttoken": False}
_SETTINGS = frozenset({"max_seq_length", "do_lower_case"})


def _read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def max_seq_length(directory: str | Path) -> int | None:
    """The longest input, in tokens, when `directory` is a sentence-transformers directory this module
    runs as sentence-transformers would (see the module docstring); else None."""
    root = Path(directory)
    try:
        modules = json.loads((root / "modules.json").read_text())
        settings = _read(root / "sentence_bert_config.json")
        st_config = _read(root / "config_sentence_transformers.json")
        kinds = tuple(str(m["type"]).rsplit(".", 1)[-1] for m in modules)
        if kinds not in (_PIPELINE, _PIPELINE[:2]) or modules[0].get("path", "") != "":
            return None
        pooling = _read(root / modules[1]["path"] / "config.json")
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    if set(settings) - _SETTINGS or settings.get("do_lower_case") or st_config.get("prompts") or st_config.get("default_prompt_name"):
        return None
    if any(bool(pooling.get(key, False)) != want for key, want in _MEAN_ONLY.items()):
        return None
    if set(pooling) - {*_MEAN_ONLY, "word_embedding_dimension", "include_prompt"}:
        return None
    length = settings.get("max_seq_length")
    return int(length) if isinstance(length, int) and length > 0 else None


def _auto_model(directory: str | Path, device: str):
    """transformers' encoder for a directory `model/bert.py` does not run."""
    from transformers import AutoModel

    from rag_promptcache.model.loading import NO_HUB_KERNELS

    return AutoModel.from_pretrained(str(directory), **NO_HUB_KERNELS).to(device).eval()


class MeanPooled:
    """The encoder and tokenizer of such a directory; `encode` returns float32 rows of unit length [n, dim].
    `tokenizer` and `max_seq_length` are named as sentence-transformers names them (the server counts
    /v1/embeddings tokens with them)."""

    def __init__(self, directory: str | Path, max_seq_length: int, device: str | None = "cpu") -> None:
        from rag_promptcache.model.bert import BertEncoder
        from rag_promptcache.model.loading import tokenizer_from

        ours = BertEncoder.for_directory(directory, device or "cpu")
        self.model = ours if ours is not None else _auto_model(directory, device or "cpu")
        # as sentence-transformers sets it: the directory's limit, within the model's positions
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_seq_length = min(max_seq_length, positions) if isinstance(positions, int) and positions > 0 else max_seq_length
        self.tokenizer = tokenizer_from(directory, model_max_length=self.max_seq_length)
        self.dim = int(self.model.config.hidden_size)

    def encode(self, texts: Sequence[str], batch_size: int) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        out = np.empty((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # longest first: batches pad less
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                rows = order[start:start + batch_size]
                batch = self.tokenizer([texts[i] for i in rows], padding=True, truncation="longest_first",
                                       return_tensors="pt").to(self.model.device)
                states = self.model(**batch)
                states = states if isinstance(states, torch.Tensor) else states.last_hidden_state  # [B, T, H]
                mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)  # [B, T, 1]
                mean = (states * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                out[rows] = F.normalize(mean.float(), p=2, dim=1).cpu().numpy()
        return out
