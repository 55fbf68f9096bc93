"""What the routes serve: each corpus with its chat, batcher and embedder (`Served`), and the corpora
together with the names a request's `model` may give them (`Serving`).

A corpus answers to its id (its directory's name), its PML schema's name and its language model's name
(for /v1/embeddings, its embedder's name too). With one corpus served every name works as it always did;
with several, a name more than one corpus answers to (the model they share) is refused with the ids to
choose from. Corpora on one engine share its batcher, so their requests decode in one batch.
Not here: the routes (app.py), opening the corpora (rag/corpora.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rag_promptcache.engine.batching.batcher import Batcher
from rag_promptcache.rag.chat import CorpusChat
from rag_promptcache.server import responses as r
from rag_promptcache.server.embeddings import Embeddings
from rag_promptcache.server.metrics import Metrics


class ModelNotFound(LookupError):
    """A request's `model` names no corpus served here (the message says which names do)."""


@dataclass(frozen=True, slots=True)
class Served:
    """One corpus as the routes serve it."""

    chat: CorpusChat
    batcher: Batcher  # shared by the corpora on one engine
    embeddings: Embeddings
    model_id: str  # the corpus directory's name

    @property
    def aliases(self) -> frozenset[str]:
        """The names a generation request may use for this corpus: the id, the schema, the model's name."""
        return frozenset({self.model_id, self.chat.corpus.manifest.name, self.chat.corpus.engine.model_name})

    def model_card(self) -> r.ModelCard:
        corpus = self.chat.corpus
        engine, counts = corpus.engine, corpus.table.counts()
        return r.ModelCard(id=self.model_id, object="model", created=0, owned_by="rag-promptcache",
                           root=engine.model_name, max_model_len=engine.context_window,
                           schema_name=corpus.manifest.name, embedder=self.embeddings.name,
                           adapter=engine.adapter_name, num_documents=counts["num_documents"],
                           num_modules=counts["num_modules"], num_tokens=counts["num_tokens"])


@dataclass(frozen=True, slots=True)
class Serving:
    """What the routes serve, made once per app: the corpora, in the order given, and what they share."""

    corpora: tuple[Served, ...]
    metrics: Metrics
    k: int
    min_score: float | None
    html: str  # the chat page, read once: a missing file fails at start-up, not on the first visit
    _names: dict[str, tuple[Served, ...]] = field(init=False, repr=False)
    _embedders: dict[str, tuple[Served, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        assert self.corpora, f"{self.corpora=}"
        object.__setattr__(self, "_names", _by_name((a, s) for s in self.corpora for a in s.aliases))
        object.__setattr__(self, "_embedders", _by_name((s.embeddings.name, s) for s in self.corpora))

    @property
    def batchers(self) -> list[Batcher]:
        """Each batcher once (corpora on one engine share theirs)."""
        return list({id(s.batcher): s.batcher for s in self.corpora}.values())

    @property
    def names(self) -> list[str]:
        """The names that pick one corpus, for the OpenAPI schema's `model` enum."""
        return sorted(n for n, found in self._names.items() if len(found) == 1)

    def find(self, model: str, *, embedding: bool = False) -> Served:
        """The corpus `model` names; a /v1/embeddings request may name an embedder (any corpus with it
        embeds alike). `ModelNotFound` naming the ids otherwise."""
        found = self._names.get(model) or (self._embedders.get(model, ())[:1] if embedding else ())
        if len(found) == 1:
            return found[0]
        ids = ", ".join(repr(s.model_id) for s in self.corpora)
        if found:
            raise ModelNotFound(f"model {model!r} names {len(found)} corpora served here; name one of {ids}")
        serves = f"serves {ids}" if len(self.corpora) == 1 else f"serves the corpora {ids}"
        raise ModelNotFound(f"unknown model {model!r}; this server {serves}")


def _by_name(pairs: Iterable[tuple[str, Served]]) -> dict[str, tuple[Served, ...]]:
    out: dict[str, dict[int, Served]] = {}
    for name, s in pairs:
        out.setdefault(name, {})[id(s)] = s
    return {name: tuple(found.values()) for name, found in out.items()}
