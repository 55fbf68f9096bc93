"""The model and embedder a corpus uses: loading them (in the driver and in every Ray worker), and
checking that an engine, a dtype or an adapter asked for matches what the corpus's modules were encoded
with. A corpus reopens with the adapter it was encoded with (`adapter_to_load`); one encoded before
adapters shipped opens with the base model, and `untuned_notice` says how to re-encode it.

Not here: what is encoded (`encoding.py`), the engine itself (`rag_promptcache.engine`).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from rag_promptcache.rag.embed import EmbedderLike, resolve
from rag_promptcache.rag.records import Manifest

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.store.base import Store

DEFAULT_MODEL = "smollm2-135m-instruct"  # = model.loading.DEFAULT_MODEL, without importing torch
DEFAULT_ADAPTER = "default"  # = model.adapter.DEFAULT: the adapter shipped for the model, if one ships


class ModelMismatchError(ValueError):
    """The corpus's modules were encoded by another model (or other weights) than the engine's."""


def load_engine(model: str, store: Store | None, mode: str | None, dtype: str | None = None,
                adapter: str | os.PathLike[str] | None = DEFAULT_ADAPTER) -> PromptCache:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.engine.planning.background import misses_policy

    # a question never waits for a missed module's encoding: the background encoder stores it (docs/stores.md)
    return PromptCache.from_pretrained(model, store=store, dtype=dtype, adapter=adapter,
                                       misses=misses_policy(None, default="defer"),
                                       **({} if mode is None else {"mode": mode}))


def adapter_fields(engine: PromptCache) -> dict[str, str | None]:
    """The manifest's record of the engine's merged adapter: its name, digest and path ("none": the base model)."""
    a = getattr(engine, "adapter", None)  # an engine-like object without a torch model has none
    if a is None:
        return {"adapter": "none", "adapter_digest": None, "adapter_path": None}
    return {"adapter": a.name, "adapter_digest": a.digest, "adapter_path": a.path}


def adapter_to_load(manifest: Manifest, path: Path, asked: str | os.PathLike[str] | None = DEFAULT_ADAPTER) -> str:
    """The adapter that loads the model the corpus's modules were encoded with: "none" or a directory.
    `asked` "default" means that one; "none"/None or a directory must be it (`AdapterError` otherwise,
    and where the recorded adapter is not found: by digest, among the one shipped for the model and
    the directory it was loaded from)."""
    from rag_promptcache.model.adapter import DEFAULT, NONE, AdapterError, read, shipped_dir

    spec = None if asked is None else str(asked).strip()
    built = manifest.adapter if manifest.adapter_digest is not None else None
    if built is None:  # encoded with the base model
        if spec is None or spec.lower() in (DEFAULT, NONE):
            return NONE
        raise AdapterError(f"corpus {path} was encoded with the base model (no adapter), not adapter {spec!r}; "
                           f"open it without one (adapter {NONE!r}), or ingest into a new corpus to use it")
    recorded = f"adapter {built!r} (digest {manifest.adapter_digest}, loaded from {manifest.adapter_path})"
    if spec is None or spec.lower() == NONE:
        raise AdapterError(f"corpus {path} was encoded with {recorded}; the base model would not read its modules "
                           "as they were encoded: open it with that adapter, or ingest into a new corpus with adapter 'none'")
    if spec.lower() != DEFAULT:
        given = read(Path(spec).expanduser())
        if given.digest != manifest.adapter_digest:
            raise AdapterError(f"adapter {given.path!r} (digest {given.digest}) is not the one corpus {path} was "
                               f"encoded with: {recorded}")
        return given.path
    for where in (shipped_dir(manifest.model), manifest.adapter_path):
        if where is None or not Path(where).is_dir():
            continue
        try:
            found = read(Path(where))
        except AdapterError:
            continue  # damaged or another version: not the one recorded
        if found.digest == manifest.adapter_digest:
            return found.path
    raise AdapterError(f"corpus {path} was encoded with {recorded}, which is not available here; pass a copy of "
                       "that adapter directory (--adapter PATH, or adapter= in Python), or ingest into a new corpus")


def tuned_recovery(adapter_path: str | None) -> str | None:
    """The recovery the adapter at `adapter_path` was tuned for (the engine's default where a request
    names none); None for the base model (None) or an adapter that names none."""
    from rag_promptcache.model.adapter import read

    return None if adapter_path is None else read(Path(adapter_path)).recovery


def untuned_notice(manifest: Manifest, path: Path, sources: list[str]) -> str | None:
    """What to tell the user of a corpus encoded before adapters shipped (no adapter recorded) whose model
    now has one: it opens with the base model, and the command that re-encodes it with the adapter.
    None when that is not the case."""
    from rag_promptcache.model.adapter import shipped_dir

    if manifest.adapter is not None or shipped_dir(manifest.model) is None:
        return None
    return (f"corpus {path} was encoded without the tuned adapter that now ships for {manifest.model!r}, so it "
            "opens with the base model (as encoded); to answer with the tuned model, re-encode it into a new "
            f"corpus: {reencode_command(manifest, path, sources)}")


def reencode_command(manifest: Manifest, path: Path, sources: list[str], adapter: str | None = None) -> str:
    """The `ingest` that encodes a corpus's documents again into a new corpus beside it (`<path>-tuned`),
    with the same settings and `adapter` (None: the default one)."""
    files = sorted({s.partition("#")[0] for s in sources if Path(s.partition("#")[0]).is_file()})
    if len(files) > 8:
        files = [os.path.commonpath(files)]
    inputs = " ".join(shlex.quote(f) for f in files) if files else "YOUR-DOCUMENTS"
    options = [f"--corpus {shlex.quote(str(path) + '-tuned')}", f"--model {shlex.quote(manifest.model)}",
               f"--embedder {shlex.quote(manifest.embedder)}", f"--chunk-tokens {manifest.chunk_tokens}",
               f"--overlap {manifest.overlap}", f"--index {manifest.index}", f"--dtype {manifest.dtype}"]
    if adapter is not None:
        options.append(f"--adapter {shlex.quote(adapter)}")
    return f"rag-promptcache ingest {inputs} {' '.join(options)}"


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
    recorded, running = manifest.adapter_digest, adapter_fields(engine)["adapter_digest"]
    if engine.model_name == manifest.model and recorded != running:
        built = f"adapter {manifest.adapter!r} ({recorded})" if recorded else "the base model (no adapter)"
        runs = adapter_fields(engine)
        now = f"adapter {runs['adapter']!r} ({running})" if running else "the base model (no adapter)"
        raise ModelMismatchError(f"corpus {path} was encoded with {built}; this engine runs {now}: load the engine "
                                 "with the corpus's adapter, or ingest into a new corpus")
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
               embedder: str | EmbedderLike | None, adapter: str | os.PathLike[str] | None = DEFAULT_ADAPTER
               ) -> EmbedderLike | None:
    """Check what a caller asks for when opening a corpus against its manifest (`ValueError` naming
    both); returns the caller's embedder object, if one was given, to use as is."""
    check_caller_engine(engine, adapter)
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


def check_caller_engine(engine: PromptCache | None, adapter: str | os.PathLike[str] | None) -> None:
    """An adapter is merged when a model loads: a caller's engine runs its own model's, whatever `adapter` says."""
    if engine is not None and str(adapter).strip().lower() != DEFAULT_ADAPTER:
        raise ValueError(f"adapter={str(adapter)!r} applies to the model the corpus loads, not to a caller's engine; "
                         "load the engine with it instead (PromptCache.from_pretrained(..., adapter=...))")


def check_settings(manifest: Manifest, path: Path, asked: dict[str, object]) -> None:
    """Settings asked for when ingesting into an existing corpus must be its own (None: not asked)."""
    for key, value in asked.items():
        if value is not None and value != getattr(manifest, key):
            raise ValueError(f"corpus {path} uses {key}={getattr(manifest, key)!r}, not {value!r}; ingest into a new corpus to change it")
