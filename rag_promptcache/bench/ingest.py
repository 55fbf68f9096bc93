"""Ingest throughput: an eager ingest against the engine's own full prefill, a lazy one against the
eager one, and local against Ray (per worker count, `BenchConfig.ingest_workers`, where Ray is installed).

- `eager_vs_prefill`: tokens per second of a whole eager ingest of the sample documents into a new
  corpus (chunking, embedding, encoding, writes to its memory and disk tiers, commits) over the engine's
  own full prefill of a `ingest_prefill_tokens`-token prompt (pydoc modules and a question, the first
  token's time, median of `repeats_slow`), timed before and after the ingest on the same model; the
  target is `EAGER_TARGET` (an ingest is a prefill of every module, with the rest overlapped or small).
- `lazy_speedup`: the eager ingest's seconds over a lazy one's (`--kv lazy`: chunking, embedding,
  commits; no KV), the same documents.
- The eager ingest once more with the embedding the other way (`rag.ingestor.OVERLAP`: beside the
  encoding in a thread of its own, or before it): which is the default.
- `ready_vs_eager`: an ingest with `--neighbours 3 --neighbours-present 2` (ready to answer from the plain
  entries; the entries after the neighbours follow in idle time) over the eager one's seconds, against
  `READY_TARGET`; beside it `--neighbours 3` alone, which encodes every module after its neighbours at ingest.
- Ray rows: as before, one run per worker count, `seconds` with the workers' start, `tokens_per_s_after_start`
  without it; each worker is one CPU (one thread), the local run uses torch's threads in this process.

Each run is one ingest (minutes on two CPU cores), in the order prefill, eager, prefill, lazy, Ray:
read the ratios as rough on a shared machine. Not here: how ingest works (`rag/corpus.py`,
`rag/ingestor.py`, `rag/distributed.py`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import torch

from rag_promptcache.bench.common import QUESTION, Bench, module_texts, schema_pml
from rag_promptcache.rag import ingestor
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.sample import TOPICS, sample_documents

EAGER_TARGET = 0.8
READY_TARGET = 1.5  # a corpus keeping both entries is ready to answer within this of an eager ingest's seconds


def run(bench: Bench) -> dict[str, object]:
    cfg = bench.config
    docs = sample_documents(TOPICS[: cfg.ingest_topics])
    prefill = [full_prefill(bench)]
    runs = [_ingest(bench, docs, "eager")]
    prefill.append(full_prefill(bench))
    runs.append(_ingest(bench, docs, "lazy"))
    runs.append(_ingest(bench, docs, "eager", overlap=not ingestor.OVERLAP))
    runs.append(_ingest(bench, docs, "eager", name="local, eager, --neighbours 3 --neighbours-present 2 (ready)",
                        neighbours=3, neighbours_present=2))
    runs.append(_ingest(bench, docs, "eager", name="local, eager, --neighbours 3", neighbours=3))
    runs += _ray_runs(bench, docs)
    prefill_tps = statistics.mean(p["tokens_per_s"] for p in prefill)
    eager, lazy = runs[0], runs[1]
    ratio = eager["tokens_per_s"] / prefill_tps if prefill_tps else 0.0
    for row in runs:
        row["vs_local"] = row["tokens_per_s"] / eager["tokens_per_s"] if eager["tokens_per_s"] else 0.0
    out = {
        "runs": runs, "modules": eager["modules"], "tokens": eager["tokens"], "full_prefill": prefill,
        "full_prefill_tokens_per_s": prefill_tps, "eager_vs_prefill": ratio, "eager_target": EAGER_TARGET,
        "eager_passed": ratio >= EAGER_TARGET, "lazy_speedup": eager["seconds"] / lazy["seconds"] if lazy["seconds"] else None,
        "ready_vs_eager": runs[3]["seconds"] / eager["seconds"], "ready_target": READY_TARGET,
        "note": f"one run each on {os.cpu_count()} CPU(s); local: {torch.get_num_threads()} torch threads; "
                "Ray: 1 thread per worker",
    }
    bench.log(f"ingest: eager {eager['tokens_per_s']:.0f} tokens/s, full prefill {prefill_tps:.0f} tokens/s: "
              f"{ratio:.2f} of it ({'met' if out['eager_passed'] else 'MISSED'}: target {EAGER_TARGET}); "
              f"lazy {out['lazy_speedup']:.1f}x faster than eager; ready with both entries kept in "
              f"{out['ready_vs_eager']:.2f}x the eager seconds ({'met' if out['ready_vs_eager'] <= READY_TARGET else 'MISSED'}: "
              f"target {READY_TARGET}x)")
    return out


def full_prefill(bench: Bench) -> dict[str, object]:
    """The engine's own full prefill of a prompt of about `ingest_prefill_tokens` tokens: tokens per second
    to the first token (median of `repeats_slow` after a warm-up)."""
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.pml.build import prompt_pml
    from rag_promptcache.store import MemoryStore

    cfg = bench.config
    n = max(1, cfg.ingest_prefill_tokens // cfg.module_tokens)
    pc = PromptCache(bench.model, bench.tokenizer, store=MemoryStore(), name=bench.model_name,
                     **bench.engine_options)
    pc.add_schema(schema_pml("bench_ingest", {f"d{i}": t for i, t in enumerate(module_texts(bench.tokenizer, n,
                                                                                             cfg.module_tokens))}))
    prompt = prompt_pml("bench_ingest", [f"d{i}" for i in range(n)], [("user", QUESTION)])
    pc.generate(prompt, use_cache=False, max_new_tokens=1)  # warm-up
    results = [pc.generate(prompt, use_cache=False, max_new_tokens=1) for _ in range(max(1, cfg.repeats_slow))]
    ttft = statistics.median(r.ttft_s for r in results)
    tokens = results[0].prompt_tokens
    return {"tokens": tokens, "ttft_s": ttft, "tokens_per_s": tokens / ttft if ttft > 0 else 0.0}


def _ingest(bench: Bench, docs: list, kv: str, ray=None, name: str | None = None,
            overlap: bool = ingestor.OVERLAP, **neighbours: int) -> dict[str, object]:
    cfg = bench.config
    name = name or f"local, {kv}" + ("" if overlap == ingestor.OVERLAP else
                                      ", embedding beside encoding" if overlap else ", embedding then encoding")
    bench.log(f"ingest: {name} …")
    default, ingestor.OVERLAP = ingestor.OVERLAP, overlap  # the other way, for this row only
    try:
        with tempfile.TemporaryDirectory() as tmp:
            # The corpus loads its own model (before its clock starts), as `rag-promptcache ingest` does.
            corpus = Corpus.build(docs, Path(tmp) / "c", model=bench.model_name, chunk_tokens=cfg.module_tokens,
                                  adapter=cfg.adapter, dtype=cfg.dtype, progress=False, ray=ray, kv=kv, redis_url="",
                                  **neighbours)
            r = corpus.last_report
            corpus.close()
    finally:
        ingestor.OVERLAP = default
    assert r is not None and not r.failed, f"{r=}"
    after = r.seconds - r.worker_start_seconds
    bench.log(f"ingest: {name}: {r.summary()}")
    return {
        "run": name, "kv": kv, "workers": r.workers, "seconds": r.seconds, "worker_start_s": r.worker_start_seconds,
        "modules": r.num_modules, "tokens": r.num_tokens, "tokens_per_s": r.tokens_per_s,
        "modules_per_s": r.modules_per_s, "tokens_per_s_after_start": r.num_tokens / after if after > 0 else 0.0,
        "encode_s": r.encode_seconds, "kv_written_by": r.kv_written_by,
    }


def _ray_runs(bench: Bench, docs: list) -> list[dict[str, object]]:
    if not bench.config.ingest_workers:
        return []
    try:
        import ray
    except ImportError:
        bench.log("ingest: Ray rows skipped: ray is not installed (pip install 'rag-promptcache[ray]')")
        return []
    from rag_promptcache.rag.distributed import RayOptions, connect

    started = connect(ray, RayOptions(workers=max(bench.config.ingest_workers)))
    try:
        return [_ingest(bench, docs, "eager", RayOptions(workers=w), f"ray, {w} worker(s)")
                for w in bench.config.ingest_workers]
    finally:
        if started:
            ray.shutdown()


def markdown(ing: dict[str, object]) -> list[str]:
    from rag_promptcache.bench.tables import table

    fp = ing.get("full_prefill_tokens_per_s")
    head = [f"## Ingest ({ing['modules']} modules, {ing['tokens']} tokens; {ing['note']})", ""]
    if fp:
        verdict = "met" if ing["eager_passed"] else "MISSED"
        head += [f"Eager ingest at {ing['eager_vs_prefill']:.2f} of the engine's own full prefill ({fp:.0f} tokens/s, "
                 f"a {ing['full_prefill'][0]['tokens']}-token prompt): target {ing['eager_target']} {verdict}. "
                 f"Lazy ingest {ing['lazy_speedup']:.1f}x faster than eager."
                 + (f" A corpus keeping both entries (`--neighbours 3 --neighbours-present 2`) ready to answer in "
                    f"{ing['ready_vs_eager']:.2f}x the eager seconds: target {ing['ready_target']}x "
                    f"{'met' if ing['ready_vs_eager'] <= ing['ready_target'] else 'MISSED'}." if "ready_vs_eager" in ing else ""), ""]
    return head + [table(
        ["run", "seconds", "workers' start s", "tokens/s", "modules/s", "tokens/s after start", "vs local eager",
         "KV written by"],
        [[r["run"], r["seconds"], r["worker_start_s"], r["tokens_per_s"], r["modules_per_s"], r["tokens_per_s_after_start"],
          r["vs_local"], r["kv_written_by"] if r.get("kv", "eager") == "eager" else "none (lazy)"]
         for r in ing["runs"]]), ""]
