"""Tuned adapters: finding one, checking it, and merging it into a model's weights.

An adapter is a directory holding peft's LoRA files (`adapter_config.json`,
`adapter_model.safetensors`, as `PeftModel.save_pretrained` writes them) and `tune.json`:

    {"format": 1, "base_model": "<name>", "base_fingerprint": "<model_fingerprint of the base in fp32>",
     "mode": "shared_prefix", "recovery": "none", "recipe": {...}, "metrics": {...}}

`mode` is the encoding mode it was tuned for; `recovery` the recovery it was tuned and chosen for (the
engine's default where a request names none). An adapter trained with link tokens also holds
`links.safetensors` (model/links.py): their embeddings, installed at the merge and digested with the
LoRA. An adapter that ships for a model lies in `adapters/<model name>/` beside this file (package
data); `spec` "default" picks it up.

The adapter is merged into the weights at load (`merge`), so inference runs the plain model and
costs nothing extra; the model then carries an `Adapter` record (`applied`), from which the weight
fingerprint is made (model/loading.py).

Out of scope: training (the tune command), other adapter kinds than peft's, unmerged serving.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rag_promptcache.model import links

if TYPE_CHECKING:
    import torch

TUNE_FILE = "tune.json"
TUNE_FORMAT = 1
FILES = ("adapter_config.json", "adapter_model.safetensors", TUNE_FILE)
DIGESTED = ("adapter_config.json", "adapter_model.safetensors", links.FILE)  # what changes the model (links: if any)
SHIPPED = Path(__file__).resolve().parent / "adapters"
DEFAULT = "default"  # the adapter shipped for the model, if one ships
NONE = "none"  # the base model
_REQUIRED_KEYS = ("base_model", "base_fingerprint", "mode")
_ATTR = "_rag_promptcache_adapter"


class AdapterError(ValueError):
    """An adapter asked for cannot be used: missing, malformed, or tuned for another base model."""


@dataclass(frozen=True, slots=True)
class Adapter:
    """What was (or will be) merged into a model's weights."""

    name: str  # the directory's name
    path: str  # the directory, resolved
    digest: str  # 16 hex digits over the files that change the weights
    recovery: str | None  # the recovery it was tuned for: the engine's default where none is named
    mode: str  # the encoding mode it was tuned for
    base_model: str
    base_fingerprint: str
    shipped: bool  # it ships with this package for `base_model`
    num_links: int = 0  # trained link tokens (model/links.py); 0: none
    num_wrap: int = 0  # trained wrapper tokens on each side of every module (model/links.py); 0: none


def shipped_dir(model_name: str) -> Path | None:
    """The adapter shipped for `model_name` (an alias or a hub id; a hub id's "/" is "--" in the
    directory name), or None when none ships."""
    name = model_name.strip().lower().replace("/", "--")
    if not name or name.startswith(".") or Path(name).name != name:
        return None  # a path is not a model name with a shipped adapter
    directory = SHIPPED / name
    return directory if (directory / TUNE_FILE).is_file() else None


def find(spec: str | Path | None, model_name: str) -> Adapter | None:
    """The adapter `spec` names for `model_name`: None or "none" → None (the base model); "default" →
    the one shipped for the model, else None; anything else is the path of an adapter directory.
    Raises `AdapterError` naming what is wrong with the directory."""
    if spec is None or str(spec).strip().lower() == NONE:
        return None
    if isinstance(spec, str) and spec.strip().lower() == DEFAULT:
        directory = shipped_dir(model_name)
        return None if directory is None else read(directory)
    return read(Path(spec).expanduser())


def read(directory: Path) -> Adapter:
    """Read and check an adapter directory (files present, `tune.json` well formed, its format known)."""
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise AdapterError(f"adapter {str(directory)!r} {what}; pass an adapter directory ({', '.join(FILES)}), "
                           f"{DEFAULT!r} (the one shipped for the model) or {NONE!r} (the base model)")
    if missing := [f for f in FILES if not (directory / f).is_file()]:
        raise AdapterError(f"adapter {str(directory)!r} lacks {', '.join(missing)}; an adapter directory holds "
                           f"{', '.join(FILES)} (peft's save_pretrained writes the first two)")
    where = directory / TUNE_FILE
    try:
        tune = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{where} is not readable JSON: {e}") from e
    if not isinstance(tune, dict):
        raise AdapterError(f"{where} holds {type(tune).__name__}, not an object")
    if tune.get("format") != TUNE_FORMAT:
        raise AdapterError(f"{where}: adapter format {tune.get('format')!r}, this version reads format {TUNE_FORMAT}; "
                           "use an adapter tuned for this version, or upgrade rag-promptcache")
    if missing := [k for k in _REQUIRED_KEYS if not isinstance(tune.get(k), str) or not tune[k]]:
        raise AdapterError(f"{where} lacks {', '.join(missing)} (each a non-empty string)")
    recovery = tune.get("recovery")
    if recovery is not None and not isinstance(recovery, str):
        raise AdapterError(f"{where}: recovery must be a string like 'none' or 'last:1', not {recovery!r}")
    resolved = directory.resolve()
    try:
        table, wrap = links.load(resolved), links.wrap_of(resolved)
    except Exception as e:  # safetensors raises its own types for a damaged file
        raise AdapterError(f"{resolved / links.FILE} is not a readable link table: {e}") from e
    return Adapter(name=resolved.name, path=str(resolved), digest=digest(resolved), recovery=recovery,
                   mode=tune["mode"], base_model=tune["base_model"], base_fingerprint=tune["base_fingerprint"],
                   shipped=resolved.parent == SHIPPED, num_links=0 if table is None else int(table.shape[0]) - 2 * wrap,
                   num_wrap=wrap)


def digest(directory: Path) -> str:
    """16 hex digits over the LoRA's config and weights and the link table where there is one (not
    `tune.json`, whose metrics change nothing)."""
    h = hashlib.sha256()
    for name in DIGESTED:
        if name == links.FILE and not (directory / name).is_file():
            continue  # an adapter without links keeps the digest it always had
        h.update(f"{name}\0".encode())
        with open(directory / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()[:16]


def check_base(adapter: Adapter, model_name: str, fingerprint: str) -> None:
    """The adapter must have been tuned on these weights: `fingerprint` is the base model's in fp32."""
    if fingerprint != adapter.base_fingerprint:
        raise AdapterError(
            f"adapter {adapter.path!r} was tuned for base model {adapter.base_model!r} (fingerprint "
            f"{adapter.base_fingerprint}), not {model_name!r} (fingerprint {fingerprint}); load the model it "
            f"was tuned for, or pass adapter {NONE!r} for the base model"
        )


@contextmanager
def peft_quiet() -> Iterator[None]:
    """peft asks transformers `is_gradient_checkpointing`, which transformers 5 renamed and warns about: its
    notice, not the user's to act on, and ours to fix only in peft. Only that warning is filtered."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def merge(model: torch.nn.Module, adapter: Adapter, fingerprint: str, model_name: str) -> torch.nn.Module:
    """The model with the adapter's LoRA merged into its weights (peft's `merge_and_unload`), carrying
    the `Adapter` record that `applied` returns. `fingerprint`: the model's, in fp32, before the merge;
    it must be the one the adapter was tuned on (`check_base`)."""
    return attach(merge_weights(model, adapter, fingerprint, model_name), adapter)


def merge_weights(model: torch.nn.Module, adapter: Adapter, fingerprint: str, model_name: str) -> torch.nn.Module:
    """`merge`'s first half: the LoRA merged into the weights, no link table and no record yet; what
    the merged-weights cache saves (model/loading.py)."""
    from peft import PeftModel

    check_base(adapter, model_name, fingerprint)
    try:
        with peft_quiet():
            return PeftModel.from_pretrained(model, adapter.path).merge_and_unload()
    except (ValueError, KeyError, RuntimeError) as e:
        raise AdapterError(f"adapter {adapter.path!r} does not fit this model: {e}") from e


def attach(merged: torch.nn.Module, adapter: Adapter) -> torch.nn.Module:
    """`merge`'s second half, on weights `merge_weights` made (now or in a cached copy): the adapter's
    link table installed, and its record set."""
    table = links.load(adapter.path)
    if table is not None:
        try:
            links.install(merged, table, adapter.num_wrap)
        except ValueError as e:
            raise AdapterError(f"adapter {adapter.path!r} does not fit this model: {e}") from e
    setattr(merged, _ATTR, adapter)
    return merged


def applied(model: torch.nn.Module) -> Adapter | None:
    """The adapter merged into `model`'s weights by `merge`; None for a base model."""
    return getattr(model, _ATTR, None)
