"""Ingest throughput: module encoding (modules/s, tokens/s) and embedding (chunks/s), and FAISS search
latency over synthetic unit vectors at 10k and 100k.

Encoding numbers come from the encodes the TTFT and quality scenarios already ran (`EncodeReport`);
run alone, this scenario encodes a few modules itself. Not here: chunking or SQLite ingest costs.
"""

from __future__ import annotations

import time

import numpy as np

from rag_promptcache.bench.common import Bench, median, module_texts, schema_pml, timed
from rag_promptcache.engine import DEFAULT_MODE, PromptCache
from rag_promptcache.store import NullStore
from rag_promptcache.timing import describe, ratio

SCHEMA = "bench_throughput"


def run(bench: Bench) -> dict[str, object]:
    return {"encode": _encode(bench), "embed": _embed(bench), "faiss": [_faiss(bench, n) for n in bench.config.faiss_sizes]}


def _encode(bench: Bench) -> list[dict[str, object]]:
    reports = [(DEFAULT_MODE, "ttft modules", bench.extras["ttft_encode"])] if "ttft_encode" in bench.extras else []
    reports += [(mode, "demo modules", r) for mode, r in bench.extras.get("quality_encode", {}).items()]
    if not reports:
        pc = PromptCache(bench.model, bench.tokenizer, store=NullStore(), name=bench.model_name, prefix_cache_bytes=0)
        pc.add_schema(schema_pml(SCHEMA, {f"d{i}": t for i, t in enumerate(module_texts(bench.tokenizer, 4, 256))}))
        reports = [(pc.mode, "4 modules", pc.encode(SCHEMA))]
    rows = []
    for mode, what, r in reports:
        rows.append({"mode": mode, "what": what, "modules": r.num_modules, "tokens": r.num_tokens, "seconds": r.seconds,
                     "modules_per_s": ratio(r.num_modules, r.seconds), "tokens_per_s": ratio(r.num_tokens, r.seconds)})
        bench.log(f"encode ({what}, {mode}): {describe(rows[-1]['modules_per_s'], '.2f', ' modules/s')}, "
                  f"{describe(rows[-1]['tokens_per_s'], '.0f', ' tokens/s')}")
    return rows


def _embed(bench: Bench) -> dict[str, object]:
    if not bench.config.embed:
        return {"skipped": "embedding disabled for this run"}
    try:
        from rag_promptcache.rag.embed import Embedder

        t0 = time.perf_counter()
        embedder = Embedder()
        load_s = time.perf_counter() - t0
    except (ImportError, ValueError) as e:
        return {"skipped": f"no embedder: {e}"}
    texts = module_texts(bench.tokenizer, 32, 256)
    embedder.embed(texts[:2])  # warm-up
    seconds = timed(lambda: embedder.embed(texts), bench.device, bench.min_span_s)[0]
    out = {"model": embedder.name, "dim": embedder.dim, "load_s": load_s, "chunks": len(texts),
           "chunk_tokens": 256, "seconds": seconds, "chunks_per_s": ratio(len(texts), seconds),
           "tokens_per_s": ratio(256 * len(texts), seconds)}
    bench.log(f"embed ({embedder.name}): {describe(out['chunks_per_s'], '.1f', ' chunks/s')}")
    return out


def _faiss(bench: Bench, n: int, dim: int = 384, k: int = 4) -> dict[str, object]:
    from rag_promptcache.rag.index import VectorIndex

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, dim), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = VectorIndex(dim, "flat")
    t0 = time.perf_counter()
    index.add(np.arange(n, dtype=np.int64), vectors)
    build_s = time.perf_counter() - t0
    queries = rng.standard_normal((bench.config.faiss_queries, dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    index.search(queries[:1], k)
    lat = []
    for q in queries:
        t0 = time.perf_counter()
        index.search(q, k)
        lat.append(time.perf_counter() - t0)
    every = timed(lambda: [index.search(q, k) for q in queries], bench.device, bench.min_span_s)[0]
    # one search read alone means something only where it spans enough steps of the clock
    alone = median(lat) >= bench.min_span_s
    out = {"vectors": n, "dim": dim, "kind": "flat", "k": k, "build_s": build_s, "search_ms_mean": 1000 * every / len(queries),
           "search_ms_median": 1000 * median(lat) if alone else None,
           "search_ms_p95": 1000 * float(np.percentile(lat, 95)) if alone else None}
    bench.log(f"faiss {n} vectors: search {out['search_ms_mean']:.3f} ms mean, {describe(out['search_ms_median'], '.2f', ' ms')} "
              f"median, {describe(out['search_ms_p95'], '.2f', ' ms')} p95")
    return out
