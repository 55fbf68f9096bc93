"""The one owner of a corpus's engine. A caller's engine stays the caller's (its store is theirs to close);
an engine the corpus loads on first use, or one `Corpus.build` loaded for a new corpus, is the corpus's:
its store is resized and closed with it, and the corpus's recorded recovery becomes its default.

`Corpus` holds one `EngineSlot` (`corpus.engine_slot`); what else needs the engine receives it from
there: `get` (a callable: the ingestor's parts, `Answering.retrieve`, `lazy.warm`), `loaded` (the engine if
one is loaded, without loading one: `lazy.held_keys`) or `owned` (the engine only where it is the corpus's:
what may be resized or closed). Not here: loading (rag/models.py, through the corpus's `load`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache


class EngineSlot:
    """A corpus's engine: given, or loaded by `load` on the first `get` (under `lock`)."""

    def __init__(self, load: Callable[[], PromptCache], engine: PromptCache | None = None, *,
                 lock: threading.RLock | None = None) -> None:
        self._load = load
        self._engine = engine
        self._owned = False  # a caller's engine (and its store) is the caller's to close
        self._lock = lock or threading.RLock()

    def get(self) -> PromptCache:
        """The engine, loaded (and from then on the corpus's) where none was given."""
        with self._lock:
            if self._engine is None:
                engine = self._load()
                self._engine, self._owned = engine, True
            return self._engine

    @property
    def loaded(self) -> PromptCache | None:
        """The engine if one is loaded or was given; None without loading one."""
        return self._engine

    @property
    def owned(self) -> PromptCache | None:
        """The engine where it is the corpus's (loaded by it, or `adopt`ed), else None."""
        return self._engine if self._owned else None

    def adopt(self) -> None:
        """The given engine becomes the corpus's: `Corpus.build` loaded it for the corpus it creates."""
        self._owned = self._engine is not None

    def close(self) -> None:
        """Stop the background encoder of an engine that is the corpus's (the module in hand is written whole,
        what is queued is a miss next time) and close its store; a caller's is left open."""
        if (engine := self.owned) is not None:
            engine.background.close()
            engine.store.close()
