"""What the RAG layer hands out: the corpus `Manifest`, an `IngestReport`, an `Answer` and its stream."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rag_promptcache.engine import Result, Stream
    from rag_promptcache.rag.retrieval import Hit

MANIFEST_FORMAT = 1


@dataclass(frozen=True, slots=True)
class Manifest:
    """`manifest.json`: everything that must match for a corpus's modules and vectors to be valid."""

    name: str  # the schema's name in the engine
    model: str
    fingerprint: str
    mode: str
    embedder: str
    dim: int
    chunk_tokens: int
    overlap: int
    max_tokens: int
    index: str
    instructions: str
    package_version: str
    created: float
    updated: float
    format: int = MANIFEST_FORMAT
    dtype: str = "float32"  # the model's dtype when the modules were encoded; manifests before it: float32
    # The recovery `eval --apply` chose for this corpus, the default of its engine and of `ask`;
    # None (and manifests before it): the engine's own default.
    recovery: str | None = None
    # The tuned adapter merged into the model when the modules were encoded (model/adapter.py): its name,
    # or "none" for the base model; None (manifests before it): the base model, from before adapters shipped.
    adapter: str | None = None
    adapter_digest: str | None = None  # what the adapter's files hash to: a reopen loads only this one
    adapter_path: str | None = None  # where it was loaded from (an adapter that ships is found by digest first)
    # The KV codec of the corpus's tiers (`ingest --codec`, store/codecs.py); manifests before it: fp16,
    # the one codec corpora were written with then.
    codec: str = "fp16"
    # When module KV is computed (`ingest --kv`, rag/lazy.py): "eager", every module at ingest; "lazy", when
    # a question first retrieves it. Manifests before it: eager.
    kv: str = "eager"
    # The store's budget per tier in bytes, set once (`ingest --store-budget`, rag/budget.py) and honoured by
    # every process that opens the corpus; None: unbounded. The memory tier's is per process.
    memory_budget: int | None = 1 << 30
    disk_budget: int | None = None
    redis_budget: int | None = None
    # The eviction policy of every tier (store/eviction.py POLICIES); manifests before it: lru
    policy: str = "lru"
    # Each module's KV encoded after its this many nearest modules (`ingest --neighbours`, rag/neighbours.py);
    # 0 (and manifests before it): each alone after the instructions.
    neighbours: int = 0
    # A prompt reads a module's KV encoded after its neighbours only where at least this many of them are
    # retrieved with it, its plain KV (also stored) otherwise (`ingest --neighbours-present`); 0: always.
    neighbours_present: int = 0
    # Each module's KV kept from the prefill of the first question that retrieves it (`ingest --kv lazy
    # --byproduct`, engine/kv/byproduct.py) rather than encoded on its own; False (and manifests before it): off.
    byproduct: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(
                f"{where}: corpus format {data.get('format')!r}, this version reads format {MANIFEST_FORMAT}; "
                "re-ingest the documents into a new corpus"
            )
        known = {f.name for f in fields(cls)}
        if unknown := set(data) - known:
            raise ValueError(f"{where}: unknown manifest keys {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class StoreEstimate:
    """What an ingest is expected to add to the store, told before anything is encoded: about
    `num_tokens` new tokens (counted by the real chunker on a sample of the documents, `ingest.count_tokens`)
    and their bytes at rest in each codec (`store.codecs.bytes_per_token`); `codec` is the corpus's own.
    `kv` is how this ingest encodes: "eager" stores all of it now; "lazy" stores nothing now, and later
    what questions retrieve, within `budget` (the corpus's store budget per tier, described). A resumed
    ingest's `num_tokens` is what is left of it."""

    num_tokens: int
    codec: str
    bytes_per_codec: tuple[tuple[str, int], ...]  # (codec, expected bytes), smallest last
    kv: str = "eager"
    budget: str = ""
    room: int | None = None  # the bytes the corpus's disk (else Redis) budget holds; None: unbounded
    seconds: float | None = None  # encoding all of it on this machine (the engine's cost model); None: not modelled
    both: bool = False  # two entries a module (`neighbours_present`): the plain half now, the other in idle time

    def bytes(self, codec: str | None = None) -> int:
        return dict(self.bytes_per_codec)[codec or self.codec]


def skip_summary(skipped: Sequence[tuple[str, str]]) -> str:
    """'skipped 3 file(s) or record(s): 1 empty file, 2 unsupported type (.css 1, .png 1)' for (source,
    why) pairs, the reasons grouped by what precedes their first colon; '' for none."""
    if not skipped:
        return ""
    reasons: dict[str, int] = {}
    types: dict[str, int] = {}
    for _, why in skipped:
        head, _, rest = why.partition(":")
        reasons[head] = reasons.get(head, 0) + 1
        if head == "unsupported type":
            kind = rest.strip().split(" (supported")[0]
            types[kind] = types.get(kind, 0) + 1
    shown = ", ".join(f"{t} {n}" for t, n in sorted(types.items(), key=lambda tn: (-tn[1], tn[0]))[:6])
    more = f" and {len(types) - 6} more type(s)" if len(types) > 6 else ""
    parts = ", ".join(f"{n} {why}" + (f" ({shown}{more})" if why == "unsupported type" else "")
                      for why, n in sorted(reasons.items()))
    return f"skipped {len(skipped)} file(s) or record(s): {parts}"


@dataclass(frozen=True, slots=True)
class IngestReport:
    num_documents: int  # seen in the input
    num_unchanged: int
    num_ingested: int  # new or changed documents processed
    num_removed: int  # documents gone from an ingested directory
    num_modules: int  # new modules (embedded and encoded)
    num_tokens: int  # tokens of the new modules
    num_reused: int  # chunks whose module already existed (identical text)
    seconds: float
    encode_seconds: float
    skipped: tuple[tuple[str, str], ...]  # (file, why)
    workers: int = 0  # Ray actors that embedded and encoded (0: this process did)
    kv_written_by: str = "local"  # "local", "workers" (straight into the shared store) or "driver" (returned)
    failed: tuple[tuple[str, str], ...] = ()  # (file, why) of batches that kept failing; run ingest again
    worker_start_seconds: float = 0.0  # of `seconds`: until every Ray worker had loaded its model
    replaced: tuple[tuple[str, str], ...] = ()  # (name, old source): the same document read from another place

    @property
    def modules_per_s(self) -> float:
        return self.num_modules / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        parts = [
            f"{self.num_documents} document(s): {self.num_ingested} ingested, {self.num_unchanged} unchanged"
            + (f", {self.num_removed} removed" if self.num_removed else ""),
            f"{self.num_modules} new module(s), {self.num_tokens} tokens in {self.seconds:.1f}s"
            + (f" ({self.modules_per_s:.2g} modules/s, {self.tokens_per_s:.0f} tokens/s; "
               f"{self.encode_seconds:.1f}s of it encoding KV)" if self.num_modules else ""),
        ]
        if self.workers:
            where = "written by the workers into the corpus's store" if self.kv_written_by == "workers" else "returned to the driver and written here"
            parts.append(f"{self.workers} Ray worker(s) (started in {self.worker_start_seconds:.1f}s), module KV {where}")
        if self.replaced:
            shown = ", ".join(f"{name} (was {old})" for name, old in self.replaced[:3])
            more = f" and {len(self.replaced) - 3} more" if len(self.replaced) > 3 else ""
            parts.append(f"replaced {len(self.replaced)} document(s) of the same name ingested from another place: {shown}{more}")
        if self.skipped:
            parts.append(skip_summary(self.skipped))
        if self.failed:
            parts.append(f"FAILED {len(self.failed)} file(s) (kept incomplete; run ingest again to retry): "
                         + ", ".join(f"{f}: {why}" for f, why in self.failed))
        return "; ".join(parts)


@dataclass(frozen=True, slots=True)
class Answer:
    answer: str
    module_ids: tuple[str, ...]  # retrieved and imported, best first
    sources: tuple[str, ...]  # the source label of each module
    scores: tuple[float, ...]
    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    hit_modules: tuple[str, ...]
    missed_modules: tuple[str, ...]
    finish_reason: str
    prompt: str  # the PML prompt, for replaying (e.g. `engine.full_prefill_ttft(answer.prompt)`)
    path: str = "cached"  # "full": the planner ran a plain full prefill, faster here (engine/planning/costmodel.py)
    # of missed_modules, those computed in this answer's prefill and left to the background encoder to store
    deferred_modules: tuple[str, ...] = ()
    served: str = "store"  # `Result.served`: "store", "deferred" (missed, not waited for), "waited" or "none"
    sections: tuple[str, ...] = ()  # each module's section in its document (`Hit.section`; "" where none)
    snippets: tuple[str, ...] = ()  # the start of each module's text (`Hit.snippet`)

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        for k, v in out.items():
            if isinstance(v, tuple):
                out[k] = list(v)
        return out

    @classmethod
    def from_result(cls, result: Result, hits: Sequence[Hit], prompt: str) -> Answer:
        return cls(
            answer=result.text.strip(),
            module_ids=tuple(h.module_id for h in hits),
            sources=tuple(h.label for h in hits),
            scores=tuple(round(float(h.score), 4) for h in hits),  # type: ignore[arg-type] - retrieved hits are scored
            ttft_s=result.ttft_s,
            total_s=result.total_s,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            computed_tokens=result.computed_tokens,
            hit_modules=tuple(result.hit_modules),
            missed_modules=tuple(result.missed_modules),
            finish_reason=result.finish_reason,
            prompt=prompt,
            path=result.path,
            deferred_modules=tuple(result.deferred_modules),
            served=result.served,
            sections=tuple(h.section for h in hits),
            snippets=tuple(h.snippet for h in hits),
        )


class AnswerStream(Iterator[str]):
    """Iterate for text pieces as they are generated; `.answer` is set once the stream is exhausted."""

    def __init__(self, stream: Stream, found: Sequence[Hit], prompt: str) -> None:
        self._stream = stream
        self.found = tuple(found)  # the retrieved modules, best first, as `Answer` shows them
        self.hits = [(h.module_id, h.score) for h in found]
        self.sources = [h.label for h in found]
        self.prompt = prompt
        self.answer: Answer | None = None

    def __iter__(self) -> AnswerStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._stream)
        except StopIteration:
            if self.answer is None and self._stream.result is not None:
                self.answer = Answer.from_result(self._stream.result, self.found, self.prompt)
            raise

    def close(self) -> None:
        self._stream.close()

    def consume(self) -> Answer:
        for _ in self:
            pass
        assert self.answer is not None, "stream ended without a result"
        return self.answer
