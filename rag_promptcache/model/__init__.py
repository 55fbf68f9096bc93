"""Models: loading and fingerprints (the default model and embedder run on module sets of our own, `llama.py`
and `bert.py`, equal to transformers' and without importing its model code), tuned adapters merged at load,
chat-template role markup, and per-architecture position relocation of cached keys. No engine logic lives here."""

from rag_promptcache.model.adapter import Adapter, AdapterError
from rag_promptcache.model.chat import RoleMarkup, role_markup
from rag_promptcache.model.loading import load_model, model_fingerprint
from rag_promptcache.model.positions import (
    AbsoluteRelocator,
    KVGeometry,
    NoPositionRelocator,
    Relocator,
    RopeRelocator,
    UnsupportedModelError,
    kv_geometry,
    relocator_for,
)

__all__ = [
    "AbsoluteRelocator", "Adapter", "AdapterError", "KVGeometry", "NoPositionRelocator", "Relocator", "RoleMarkup", "RopeRelocator",
    "UnsupportedModelError", "kv_geometry", "load_model", "model_fingerprint", "relocator_for", "role_markup",
]
