"""The model and embedder a corpus uses: loading them (in the driver and in every Ray worker), and
checking that an engine or a dtype asked for matches what the corpus's modules were encoded with.

Not here: what is encoded (`encoding.py`), the engine itself (`rag_promptcache.engine`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rag_promptcache.rag.embed import EmbedderLike, resolve
from rag_promptcache.rag.records import Manifest

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.store.base import Store

DEFAULT_MODEL = "smollm2-135m-instruct"  # = model.loading.DEFAULT_MODEL, without importing torch


class ModelMismatchError(ValueError):
    """The corpus's modules were encoded by another model (or other weights) than the engine's."""


def load_engine(model: str, store: Store | None, mode: str | None, dtype: str | None = None) -> PromptCache:
    from rag_promptcache.engine import PromptCache

    return PromptCache.from_pretrained(model, store=store, dtype=dtype, **({} if mode is None else {"mode": mode}))


def load_embedder(name: str | None) -> EmbedderLike:
    from rag_promptcache.rag.embed import Embedder

    return Embedder(name)


def dtype_of(engine: PromptCache) -> str:
    """The dtype the engine computes KV in (its model's parameters)."""
    model = getattr(engine, "model", None)  # an engine-like object without a torch model computes no KV dtype
    return str(model.dtype).removeprefix("torch.") if model is not None else "float32"


def check_dtype(dtype: str | None, manifest: Manifest, path: Path) -> None:
    """A dtype asked for when opening must be the corpus's: its modules' KV was computed in that one."""
    from rag_promptcache.model.loading import dtype_name, parse_dtype

    wanted = parse_dtype(dtype)
    if wanted is not None and dtype_name(wanted) != manifest.dtype:
        raise ValueError(f"corpus {path} was encoded in {manifest.dtype}, not {dtype_name(wanted)}; open it with "
                         f"dtype {manifest.dtype!r} (or auto), or ingest into a new corpus to use {dtype_name(wanted)}")


def check_engine(engine: PromptCache, manifest: Manifest, path: Path) -> None:
    """Raise `ModelMismatchError` saying why, unless the engine computes the corpus's KV."""
    if engine.fingerprint == manifest.fingerprint:
        return
    if engine.model_name == manifest.model and dtype_of(engine) != manifest.dtype:
        raise ModelMismatchError(
            f"corpus {path} was encoded in {manifest.dtype}; this engine runs {manifest.model!r} in "
            f"{dtype_of(engine)}: load it with dtype {manifest.dtype!r}, or ingest into a new corpus"
        )
    if engine.model_name == manifest.model:
        raise ModelMismatchError(
            f"corpus {path} was built with model {manifest.model!r} whose fingerprint was "
            f"{manifest.fingerprint[:16]}; it is now {engine.fingerprint[:16]} (other weights, or a "
            "rag-promptcache upgrade changed it); re-ingest into a new corpus"
        )
    raise ModelMismatchError(
        f"corpus {path} was built with model {manifest.model!r} (fingerprint {manifest.fingerprint[:16]}), "
        f"not {engine.model_name!r} (fingerprint {engine.fingerprint[:16]})"
    )


def check_open(manifest: Manifest, path: Path, *, model: str | None, dtype: str | None, engine: PromptCache | None,
               embedder: str | EmbedderLike | None) -> EmbedderLike | None:
    """Check what a caller asks for when opening a corpus against its manifest (`ValueError` naming
    both); returns the caller's embedder object, if one was given, to use as is."""
    if model is not None and model != manifest.model:
        raise ValueError(f"corpus {path} was built with model {manifest.model!r}, not {model!r}")
    check_dtype(dtype, manifest, path)
    if engine is not None:
        check_engine(engine, manifest, path)
    if embedder is None:
        return None
    name = resolve(embedder)[0] if isinstance(embedder, str) else embedder.name
    if name != manifest.embedder:
        raise ValueError(f"corpus {path} was built with embedder {manifest.embedder!r}, not {name!r}")
    return None if isinstance(embedder, str) else embedder


def check_settings(manifest: Manifest, path: Path, asked: dict[str, object]) -> None:
    """Settings asked for when ingesting into an existing corpus must be its own (None: not asked)."""
    for key, value in asked.items():
        if value is not None and value != getattr(manifest, key):
            raise ValueError(f"corpus {path} uses {key}={getattr(manifest, key)!r}, not {value!r}; ingest into a new corpus to change it")
