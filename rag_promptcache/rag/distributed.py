"""Distributed ingestion on Ray: chunk batches are embedded and encoded by a pool of Ray actors.

The driver does what is cheap and must be ordered: loading, chunking, deciding which modules are
new, and committing (the ingestor's `commit`, which a local ingest runs too), one batch at a time
in submission order, so an interrupted run leaves whole batches and resumes with or without Ray.
Each actor loads the model and the embedder once and, per batch, runs `encoding.encode_modules` (the
same call a local ingest makes): it returns the vectors and stores the modules' KV. With neighbours
(`--neighbours`, rag/neighbours.py) the driver embeds each batch and chooses its neighbours itself, as a
local ingest does, searching the batches in flight beside the index, and the actor only encodes the KV
(`encoding.encode_kv`), so the lists, keys and KV are a local ingest's. Where the KV goes (`RayOptions.kv`):
- "workers": the actors write into the corpus's store themselves: its Redis tier, and its disk
  directory when every node sees it (a local cluster does; a shared filesystem does);
- "driver": the actors return the KV (fp16, as it is stored at rest) and the driver writes it;
- "auto" (default): "workers" when the cluster is this machine or the corpus has a reachable Redis
  tier, else "driver".

Why plain actors and not Ray Data `map_batches` with an actor pool: the commit must follow the
submission order (resume and per-document completion depend on it) and a failed batch must be
named with its source files while the rest goes on; with actors that is a small in-order window of
object refs, while a Ray Data pipeline fails as a whole on a block that keeps failing (unless
`DataContext.max_errored_blocks` lets it skip blocks, and then the driver must work out which
files they held), and its output would have to be re-ordered for the commits. Ray Data's gains
(streaming from storage, autoscaling pools) matter little here: the driver already holds the
chunks, and the pool is fixed by the model's memory. Decided on these grounds; Ray Data was not
benchmarked.

Failures: an actor whose process dies is restarted and its batch retried (`max_restarts`,
`max_task_retries`); a batch that raises is retried too; one that still fails is reported in
`IngestReport.failed` with its source files, which stay incomplete (the next ingest retries them),
and the rest of the corpus is kept. With neighbours, so do the batches sent while it was in flight:
they may share its modules or name them as neighbours.

Not here: chunking, the table or the index (`ingestor.py`), the encoding itself (`encoding.py`), the
tiers (`corpus_store.py`).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rag_promptcache.rag.budget import StoreBudget
from rag_promptcache.rag.chunker import search_text
from rag_promptcache.rag.corpus_store import open_store
from rag_promptcache.rag.encoding import NONE, Batch, Encoded, Neighbours, encode_kv, encode_modules
from rag_promptcache.rag.models import adapter_to_load, load_embedder, load_engine
from rag_promptcache.rag.neighbours import Unindexed
from rag_promptcache.rag.records import Manifest

if TYPE_CHECKING:
    from rag_promptcache.rag.chunker import Chunk
    from rag_promptcache.store import EncodedKV, ModuleKV, Store

KV_SINKS = ("auto", "workers", "driver")
INSTALL_HINT = "ingest --ray needs Ray: pip install 'rag-promptcache[ray]'"
Commit = Callable[[Batch, list[str], dict[str, "Chunk"], np.ndarray, Neighbours], None]
NewModules = Callable[[Batch], dict[str, "Chunk"]]
Choose = Callable[[dict[str, "Chunk"], Unindexed], tuple[np.ndarray, Neighbours]]  # the ingestor's `choose`


@dataclass(frozen=True, slots=True)
class Fault:
    """For tests only: fail a worker on a batch whose text contains `match`. "exit" kills the worker
    process mid-batch, once (`once_file` records that it happened); "raise" raises every time."""

    match: str
    action: str = "raise"
    once_file: str | None = None

    def __post_init__(self) -> None:
        if self.action not in ("raise", "exit"):
            raise ValueError(f"unknown fault action {self.action!r}; valid: raise, exit")


@dataclass(frozen=True, slots=True)
class RayOptions:
    address: str | None = None  # None: start a local cluster; "auto": join the running one; "ray://host:10001"
    workers: int = 2
    cpus_per_worker: float = 1.0
    kv: str = "auto"  # see KV_SINKS and the module docstring
    max_retries: int = 2  # restarts of a dead worker, and retries of a batch
    fault: Fault | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.cpus_per_worker <= 0:
            raise ValueError(f"cpus_per_worker must be > 0, got {self.cpus_per_worker}")
        if self.kv not in KV_SINKS:
            raise ValueError(f"unknown KV destination {self.kv!r}; valid: {', '.join(KV_SINKS)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")


@dataclass(frozen=True, slots=True)
class RayTarget:
    """The corpus an ingest on Ray writes into, as the driver sees it."""

    manifest: Manifest
    store_dir: Path | None  # the corpus's disk store (absolute), None without a disk tier
    redis_url: str | None
    driver_store: Callable[[], Store]  # the driver engine's store, for KV the workers return


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    manifest: Manifest
    disk: str | None  # the corpus's store directory, when the workers write there
    redis: str | None  # the corpus's Redis URL, when the workers write there
    collect: bool  # return the KV to the driver instead
    fault: Fault | None


@dataclass(frozen=True, slots=True)
class BatchOut:
    vectors: np.ndarray  # [modules, dim] float32, in the order sent
    kv: tuple[tuple[str, EncodedKV], ...]  # (store key, entry); empty when the worker stored it
    encode_seconds: float


@dataclass(frozen=True, slots=True)
class RayRun:
    num_workers: int
    kv_written_by: str  # "workers" or "driver"
    failed: tuple[tuple[str, str], ...]  # (source file, why)
    encode_seconds: float  # summed over the workers
    start_seconds: float  # until every worker had loaded the model and the embedder


class _Collect:
    """A store that keeps what the engine puts until the batch is returned, and remembers the keys
    so the instructions' KV is encoded and sent once per worker, not once per batch."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.pending: dict[str, ModuleKV] = {}

    def get(self, key: str) -> ModuleKV | None:
        return self.pending.get(key)

    def put(self, key: str, kv: ModuleKV) -> None:
        self.seen.add(key)
        self.pending[key] = kv

    def contains(self, key: str) -> bool:
        return key in self.seen

    def delete(self, key: str) -> bool:
        self.seen.discard(key)
        return self.pending.pop(key, None) is not None

    def stats(self):
        from rag_promptcache.store import StoreStats

        return StoreStats(len(self.pending), sum(kv.num_bytes for kv in self.pending.values()), 0, 0)

    def close(self) -> None:
        self.pending.clear()

    def take(self) -> dict[str, ModuleKV]:
        out, self.pending = self.pending, {}
        return out


class EncodeWorker:
    """One Ray actor: the model and the embedder, loaded once; `run` embeds (unless the driver did) and
    encodes a batch."""

    def __init__(self, spec: WorkerSpec) -> None:
        m = spec.manifest
        self.spec = spec
        self.collect = _Collect() if spec.collect else None
        store = self.collect or open_store(Path(spec.disk) if spec.disk else None, False, spec.redis, m.name, m.codec,
                                           StoreBudget.of(m))
        self.engine = load_engine(m.model, store, m.mode, m.dtype, adapter_to_load(m, Path(spec.disk or m.name)))
        if self.engine.fingerprint != m.fingerprint:
            raise ValueError(f"worker on {os.uname().nodename} loaded {m.model!r} with fingerprint "
                             f"{self.engine.fingerprint[:16]}, the corpus was built with {m.fingerprint[:16]}")
        self.embedder = load_embedder(m.embedder)

    def pid(self) -> int:
        return os.getpid()

    def run(self, modules: list[tuple[str, str]], embed_texts: list[str] | None, near: Neighbours = NONE) -> BatchOut:
        """`embed_texts` None: the driver embedded the modules (and chose `near`); only their KV is encoded."""
        from rag_promptcache.store import encode

        self._fault(modules)
        m = self.spec.manifest
        out = (encode_modules(self.engine, self.embedder, m, modules, embed_texts) if embed_texts is not None
               else Encoded(np.zeros((0, m.dim), np.float32), encode_kv(self.engine, m, modules, near)))
        # fp16 on the way to the driver, whose store encodes in the corpus's codec (coding twice would
        # quantize twice)
        kv = tuple((k, encode(v, "fp16")) for k, v in self.collect.take().items()) if self.collect else ()
        return BatchOut(out.vectors, kv, out.encode_seconds)

    def _fault(self, modules: list[tuple[str, str]]) -> None:
        f = self.spec.fault
        if f is None or not any(f.match in text for _, text in modules):
            return
        if f.action == "raise":
            raise RuntimeError(f"injected failure on a batch containing {f.match!r}")
        if f.once_file is None or not os.path.exists(f.once_file):
            if f.once_file is not None:
                Path(f.once_file).write_text(str(os.getpid()))
            os._exit(1)  # the process dies mid-batch, as on an OOM kill


@dataclass(slots=True)
class _Pending:
    batch: Batch
    finished: list[str]
    new: dict[str, Chunk]
    ref: object | None  # a Ray ObjectRef of BatchOut; None when nothing is new
    slot: int
    vectors: np.ndarray | None = None  # [len(new), dim], when the driver embedded them (with neighbours)
    near: Neighbours = NONE
    doomed: str | None = None  # why it fails whatever its worker returns: sent while a batch that failed was in flight


def ingest_batches(target: RayTarget, batches: Iterable[tuple[Batch, list[str]] | None], opts: RayOptions,
                   new_modules: NewModules, commit: Commit, choose: Choose | None = None) -> RayRun:
    """Run `batches` through a pool of Ray actors and `commit` each in order on this process; a None
    among them: commit every batch in flight first (`Ingestor.batches`). `new_modules(batch)`: the modules
    the corpus does not hold yet, the only ones sent. `choose` (with neighbours): embeds and chooses here."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    started = connect(ray, opts)
    actors: list[object] = []
    try:
        sink, spec = _plan(ray, target, opts)
        actor_cls = ray.remote(num_cpus=opts.cpus_per_worker, max_restarts=opts.max_retries,
                               max_task_retries=opts.max_retries)(EncodeWorker)
        t0 = time.perf_counter()
        actors = [actor_cls.remote(spec) for _ in range(opts.workers)]
        try:
            ray.get([a.pid.remote() for a in actors])  # a model or embedder a node cannot load fails here, once
        except ray.exceptions.RayError as e:
            raise ValueError(f"the Ray workers could not start: {_why(e)}") from e
        start_s = time.perf_counter() - t0
        failed: dict[str, str] = {}
        encode_s = 0.0
        store = target.driver_store() if sink == "driver" else None
        pending: deque[_Pending] = deque()
        dim = target.manifest.dim

        def fail(p: _Pending, why: str) -> None:
            for source in dict.fromkeys(s for s, _, _ in p.batch):
                failed.setdefault(source, why)
            commit([], [s for s in p.finished if s not in failed], {}, np.zeros((0, dim), np.float32), NONE)

        def finish(p: _Pending) -> None:
            nonlocal encode_s
            vectors = p.vectors if p.vectors is not None else np.zeros((0, dim), np.float32)
            if p.ref is not None:
                try:
                    out: BatchOut = ray.get(p.ref)
                except ray.exceptions.RayError as e:
                    if isinstance(e, ray.exceptions.RayActorError):  # restarts used up: a fresh one
                        actors[p.slot] = actor_cls.remote(spec)
                    if choose is not None and p.doomed is None:  # the batches behind it were chosen with it in flight
                        for q in pending:
                            q.doomed = q.doomed or f"sent while a batch that failed was in flight ({_why(e)})"
                    return fail(p, p.doomed or _why(e))
                encode_s += out.encode_seconds
                vectors = out.vectors if p.vectors is None else vectors
                if store is not None and p.doomed is None:
                    from rag_promptcache.store import decode

                    for key, enc in out.kv:
                        store.put(key, decode(enc))
            if p.doomed is not None:
                return fail(p, p.doomed)
            commit(p.batch, [s for s in p.finished if s not in failed], p.new, vectors, p.near)

        i = 0
        for item in batches:
            if item is None:
                while pending:
                    finish(pending.popleft())
                continue
            batch, finished = item
            new, vectors, near = new_modules(batch), None, NONE
            if choose is not None:
                live = [q for q in pending if q.doomed is None and q.vectors is not None]
                new = {m: c for m, c in new.items() if not any(m in q.new for q in live)}  # in flight: not new again
                if new:
                    vectors, near = choose(new, _unindexed(live, dim))
            slot, i = i % len(actors), i + 1
            texts = None if vectors is not None else [search_text(c.context, c.module_text) for c in new.values()]
            ref = actors[slot].run.options(retry_exceptions=True).remote([(m, c.module_text) for m, c in new.items()],
                                                                    texts, near) if new else None
            pending.append(_Pending(batch, finished, new, ref, slot, vectors, near))
            while len(pending) > 2 * len(actors):  # bounded: a worker always has its next batch queued
                finish(pending.popleft())
        while pending:
            finish(pending.popleft())
        return RayRun(len(actors), sink, tuple(failed.items()), encode_s, start_s)
    finally:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()


def _unindexed(live: list[_Pending], dim: int) -> Unindexed:
    """The new modules of the batches in flight, which a local ingest would have indexed by now."""
    texts = {m: c.module_text for p in live for m, c in p.new.items()}
    vectors = [p.vectors for p in live if p.vectors is not None]
    return Unindexed(texts, np.concatenate(vectors) if vectors else np.zeros((0, dim), np.float32))


def connect(ray, opts: RayOptions) -> bool:
    """Join the cluster (or start a local one); True when this call started Ray and must stop it."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, object] = {"include_dashboard": False, "logging_level": "WARNING"}
    if opts.address is None:
        # A local cluster: as many CPUs as the workers ask for, and our package on the workers' path.
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        kwargs |= {"num_cpus": max(os.cpu_count() or 1, int(np.ceil(opts.workers * opts.cpus_per_worker))),
                   "runtime_env": {"env_vars": {"PYTHONPATH": path}}}
    try:
        ray.init(address=opts.address, **kwargs)
    except ConnectionError as e:
        raise ValueError(f"cannot reach the Ray cluster at {opts.address!r}: {e}; start one with `ray start --head`, "
                         "or leave out --ray-address to start a local one") from e
    return True


def _plan(ray, target: RayTarget, opts: RayOptions) -> tuple[str, WorkerSpec]:
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < opts.workers * opts.cpus_per_worker:
        raise ValueError(f"{opts.workers} worker(s) of {opts.cpus_per_worker} CPU need "
                         f"{opts.workers * opts.cpus_per_worker:g} CPUs; the cluster has {cpus:g}: pass fewer --workers")
    local = _local_cluster(ray)
    redis = target.redis_url if target.redis_url and _reachable(target.redis_url) else None
    sink = opts.kv if opts.kv != "auto" else ("workers" if local or redis else "driver")
    disk = str(target.store_dir) if target.store_dir is not None and (local or opts.kv == "workers") else None
    if sink == "workers" and disk is None and target.redis_url is None:
        raise ValueError("kv='workers' needs a Redis tier (--redis-url) or the corpus's disk store on every node")
    spec = WorkerSpec(target.manifest, disk if sink == "workers" else None, target.redis_url if sink == "workers" else None,
                      sink == "driver", opts.fault)
    return sink, spec


def _local_cluster(ray) -> bool:
    """Every live node is this machine, so the corpus's disk store is shared."""
    here = ray.util.get_node_ip_address()
    return all(n["NodeManagerAddress"] == here for n in ray.nodes() if n["Alive"])


def _reachable(url: str) -> bool:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        return bool(client.ping())
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError):
        return False
    finally:
        client.close()


def _why(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e
    text = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {text[-1] if text else ''}"[:300]
