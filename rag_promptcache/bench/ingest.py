"""Ingest throughput, local against Ray: the same sample documents ingested into a new corpus once
here and once on a local Ray cluster per worker count (`BenchConfig.ingest_workers`).

Each run is one ingest (no repeats: minutes each on two CPU cores), in the order local, then Ray by
worker count, so a noisy neighbour is not averaged out; read the ratios as rough. `seconds` is the
whole ingest (chunking, embedding, encoding, commits) and, for Ray, includes the workers' start
(each loads the model and the embedder); `tokens_per_s_after_start` leaves that start out. The
local run uses torch's threads in this process; each Ray worker is one CPU (one thread).

Not here: how ingest works (`rag/corpus.py`, `rag/distributed.py`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from rag_promptcache.bench.common import Bench
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.sample import TOPICS, sample_documents


def run(bench: Bench) -> dict[str, object]:
    try:
        import ray
    except ImportError:
        return {"skipped": "ray is not installed (pip install 'rag-promptcache[ray]')"}
    from rag_promptcache.rag.distributed import RayOptions, connect

    cfg = bench.config
    docs = sample_documents(TOPICS[: cfg.ingest_topics])
    started = connect(ray, RayOptions(workers=max(cfg.ingest_workers, default=1)))
    runs: list[dict[str, object]] = []
    try:
        for workers in (0, *cfg.ingest_workers):
            name = "local" if not workers else f"ray, {workers} worker(s)"
            bench.log(f"ingest: {name} …")
            with tempfile.TemporaryDirectory() as tmp:
                # The corpus loads its own model (before its clock starts), as `rag-promptcache ingest` does.
                corpus = Corpus.build(docs, Path(tmp) / "c", model=bench.model_name, chunk_tokens=cfg.module_tokens,
                                      adapter=cfg.adapter, progress=False, ray=RayOptions(workers=workers) if workers else None)
                r = corpus.last_report
                corpus.close()
            assert r is not None and not r.failed, f"{r=}"
            after = r.seconds - r.worker_start_seconds
            runs.append({
                "run": name, "workers": workers, "seconds": r.seconds, "worker_start_s": r.worker_start_seconds,
                "modules": r.num_modules, "tokens": r.num_tokens, "tokens_per_s": r.tokens_per_s,
                "modules_per_s": r.modules_per_s, "tokens_per_s_after_start": r.num_tokens / after if after > 0 else 0.0,
                "encode_s": r.encode_seconds, "kv_written_by": r.kv_written_by,
            })
            bench.log(f"ingest: {name}: {r.summary()}")
    finally:
        if started:
            ray.shutdown()
    base = runs[0]["tokens_per_s"]
    for row in runs:
        row["vs_local"] = row["tokens_per_s"] / base if base else 0.0
    return {
        "runs": runs, "modules": runs[0]["modules"], "tokens": runs[0]["tokens"],
        "note": f"one run each on {os.cpu_count()} CPU(s); local: {torch.get_num_threads()} torch threads; Ray: 1 thread per worker",
    }
