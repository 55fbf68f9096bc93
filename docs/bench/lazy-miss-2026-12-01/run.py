"""A lazy corpus under a budget smaller than the corpus: each question's TTFT against the engine's own full
prefill of the same prompt, with misses deferred (computed in the request, stored by the background
encoder while no request runs; the default) or encoded before the answer (the behaviour before), at the
default fallback ("auto"). The shape of `bench --scenarios sustained --sustained-size large`, smaller:
`tokens` of this machine's real text, novel Zipf questions (benchmarks/sustained_large.py `stream`), k = 4,
prefix cache off, memory + disk tiers at `share` of the corpus's fp16 KV. Between questions the
background encoder gets up to `think` seconds (a user's pause); a question stops a background forward
between layers (before that was built, the full prefill timed right after each answer waited for the
forward the encoder had just begun, which inflated the deferred runs' speed-ups). The eager column
(every `EAGER_EVERY`-th question: the same prompt with every module a memory hit) runs on a second engine
over the same model while this engine's encoder is held off (a request in flight on its `activity`);
before 2026-12-02 it was not held off, so the eager column of sweep-, rerun- and yield-2026-12-02.json
is no measure (docs/benchmarks.md). `full2`: a second full prefill right after the first, so the
machine's own noise (p95 of full2 / full) stands beside the p95 of ttft / full.

Run from the repository root:
python docs/bench/lazy-miss-2026-12-01/run.py OUT.json [tokens] [questions] [think] [variants]
`variants`: comma-separated MISSES:SHARE[:ADMISSION][:byproduct], default defer:0.05,encode:0.05,defer:0.2,defer:0.5
(ADMISSION: first, second:W, auto or auto:W; engine/planning/background.py; unset: first, as in the runs
made before auto became the engine's default; `byproduct`: the corpus keeps each miss's KV from its
question's prefill, `ingest --kv lazy --byproduct`, engine/kv/byproduct.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["RAG_PROMPTCACHE_STORE_PREFIX_CACHE_BYTES"] = "0"  # the store alone serves reused tokens

from benchmarks import real_text  # noqa: E402
from benchmarks.sustained_large import stream  # noqa: E402
from rag_promptcache.rag.budget import StoreBudget  # noqa: E402
from rag_promptcache.rag.corpus import Corpus  # noqa: E402

K, WARMUP, EAGER_EVERY = 4, 100, 4


def documents(corpus: Corpus) -> list[str]:
    texts: dict[str, list[str]] = {}
    for m, _ in corpus.table.modules():
        for source, _, _ in corpus.table.sources(m):
            texts.setdefault(source, []).append(corpus.text(m))
    return [" ".join(t) for t in texts.values() if t]


def eager_ttft(engine, ref, corpus: Corpus, ans) -> float:
    """The same prompt with every module a memory hit (an eager unlimited store), encoded untimed first."""
    from rag_promptcache.rag.encoding import corpus_schema

    ref.store.close()  # an eager store holding exactly this prompt's modules, nothing else
    modules = [(m, corpus.table.module(m)[0]) for m in ans.module_ids]
    ref.add_schema(corpus_schema(corpus.manifest, modules), replace=True)
    ref.encode(corpus.manifest.name)
    return ref.generate(ans.prompt, max_new_tokens=1).ttft_s


def run_one(path: Path, misses: str, share: float, questions: list[tuple[int, str]], think: float,
            admission: str = "first", byproduct: bool = False) -> dict:
    import dataclasses
    import shutil

    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag import layout
    from rag_promptcache.store import MemoryStore

    shutil.rmtree(path / "store", ignore_errors=True)
    # the same corpus, keeping by-product entries or not (its store starts empty either way)
    layout.write_manifest(path, dataclasses.replace(layout.read_manifest(path), byproduct=byproduct))
    os.environ["RAG_PROMPTCACHE_MISSES"] = misses
    os.environ["RAG_PROMPTCACHE_ENCODER_ADMISSION"] = admission  # RAG_PROMPTCACHE_ADMISSION before 2026-12-02
    corpus = Corpus.open(path, redis_url="")
    fp16 = corpus.table.counts()["num_tokens"] * 30 * 3 * 64 * 2 * 2  # SmolLM2-135M: 30 layers, 3 KV heads, d 64
    corpus.set_budget(StoreBudget(memory=int(fp16 * share / 5), disk=int(fp16 * share * 4 / 5)))
    engine = corpus.prepare()
    ref = PromptCache(engine.model, engine.tokenizer, store=MemoryStore(codec="fp16"), mode=engine.mode,
                      recovery=str(engine.recovery), prefix_cache_bytes=0, name=engine.model_name, fallback="never")
    rows = []
    t0 = time.perf_counter()
    for i, (_, q) in enumerate(questions):
        ans = corpus.ask(q, k=K, max_new_tokens=1)
        full = engine.generate(ans.prompt, use_cache=False, max_new_tokens=1).ttft_s
        full2 = engine.generate(ans.prompt, use_cache=False, max_new_tokens=1).ttft_s
        row = {"i": i, "ttft": ans.ttft_s, "full": full, "full2": full2, "path": ans.path, "served": ans.served,
               "hits": len(ans.hit_modules), "misses": len(ans.missed_modules), "eager": None}
        if i % EAGER_EVERY == 0:
            with engine.activity.request():  # this engine's background encoder gives way, as to its own requests
                row["eager"] = eager_ttft(engine, ref, corpus, ans)
        rows.append(row)
        engine.background.wait_done(timeout=think)
        if (i + 1) % 50 == 0:
            last = rows[-50:]
            print(f"{misses} {share:.3f}: {i + 1} in {time.perf_counter() - t0:.0f}s, p50 ratio "
                  f"{statistics.median(r['full'] / r['ttft'] for r in last):.2f}, hits "
                  f"{sum(r['hits'] for r in last) / (K * len(last)):.2f}", flush=True)
    bg = engine.background.stats()
    corpus.close()
    return {"misses": misses, "share": share, "admission": admission, "byproduct": byproduct, "think": think, "rows": rows,
            "background": {"encoded": bg.num_encoded, "dropped": bg.num_dropped, "failed": bg.num_failed,
                           "coalesced": bg.num_coalesced}}


def summary(run: dict) -> dict:
    rows = run["rows"][min(WARMUP, len(run["rows"]) // 2):]
    ratios = [r["full"] / r["ttft"] for r in rows]
    eager = [r["full"] / r["eager"] for r in rows if r["eager"]]
    windows = [statistics.median(r["full"] / r["ttft"] for r in run["rows"][s:s + 50])
               for s in range(0, len(run["rows"]), 50)]
    slow = sorted(r["ttft"] / r["full"] for r in run["rows"])
    noise = sorted(r["full2"] / r["full"] for r in run["rows"] if r.get("full2"))
    windows100 = [statistics.median(r["full"] / r["ttft"] for r in run["rows"][s:s + 100])
                  for s in range(0, len(run["rows"]), 100)]
    return {"misses": run["misses"], "share": run["share"], "admission": run.get("admission", "first"),
            "byproduct": run.get("byproduct", False),
            "p50_speedup": statistics.median(ratios), "windows100_p50": windows100,
            "eager_p50_speedup": statistics.median(eager) if eager else None,
            "of_eager": statistics.median(ratios) / statistics.median(eager) if eager else None,
            "p95_time_over_full": slow[int(0.95 * (len(slow) - 1))], "windows_p50": windows,
            "p95_full_over_full": noise[int(0.95 * (len(noise) - 1))] if noise else None,
            "first_over_full": run["rows"][0]["ttft"] / run["rows"][0]["full"],
            "hit_share": sum(r["hits"] for r in rows) / (K * len(rows)),
            "paths": {p: sum(r["path"] == p for r in rows) for p in ("cached", "full")},
            "background": run["background"]}


def main() -> None:
    out = Path(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    think = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
    with tempfile.TemporaryDirectory(prefix="rpc-lazy-miss-") as tmp:
        text = real_text.gather(Path(tmp) / "text", tokens)
        t0 = time.perf_counter()
        corpus = Corpus.build([text.folder], Path(tmp) / "corpus", kv="lazy", chunk_tokens=256, progress=False,
                              redis_url="")
        ingest_s = time.perf_counter() - t0
        questions = stream(documents(corpus), count, 1.0)
        info = {"tokens": corpus.table.counts()["num_tokens"], "modules": len(corpus), "ingest_s": ingest_s}
        corpus.close()
        print(info, flush=True)
        runs = []
        spec = sys.argv[5] if len(sys.argv) > 5 else "defer:0.05,encode:0.05,defer:0.2,defer:0.5"
        for variant in spec.split(","):
            misses, share, *rest = variant.split(":")
            byproduct = rest[-1:] == ["byproduct"]
            admission = ":".join(rest[:-1] if byproduct else rest) or "first"
            runs.append(run_one(Path(tmp) / "corpus", misses, float(share), questions, think, admission, byproduct))
            result = {"corpus": info, "k": K, "warmup": WARMUP, "summaries": [summary(r) for r in runs], "runs": runs}
            out.write_text(json.dumps(result, indent=1))
            print(json.dumps(result["summaries"][-1]), flush=True)


if __name__ == "__main__":
    main()
