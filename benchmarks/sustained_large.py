"""The sustained scenario at real size: a lazy corpus of millions of tokens of real text, a store of a
twentieth of its fp16 size, a thousand novel questions (`bench --scenarios sustained`, rag_promptcache/bench/sustained.py,
is the small one):

    python -m benchmarks.sustained_large --dtype bfloat16 --threads 2 --out docs/bench/sustained-large-DATE


- The corpus: `large_tokens` tokens of what this machine has (benchmarks/real_text.py: Python's reference,
  /usr/share/doc, `apt-cache dumpavail`'s package records), ingested with `--kv lazy` and timed; a slice of
  `large_eager_tokens` tokens is ingested eagerly too, and the eager ingest of the whole is its tokens per
  second applied to the whole corpus (hours here: measured on the slice, not run).
- Per tier set (`large_tiers`: memory+disk, memory+Redis on a redis-server the bench starts), the store
  empty and the corpus's budget set: memory `large_memory_share`, disk or Redis `large_shared_share` of the
  corpus's fp16 KV (together 1/20), eviction `large_policy`.
- Questions: `large_warmup` then `large_questions`, each about a document drawn by Zipf (`large_zipf`) over
  the documents: a few words of it, never the same question twice; real retrieval (`Corpus.ask`, k =
  `large_k`), answered to the first token. Every `large_full_every`-th is also run as the engine's full
  prefill of the same prompt and as a fully eager fp16 corpus with an unlimited store would run it: the
  same engine over a memory store holding the question's modules in fp16 (encoded untimed just before).
- Per `large_every` questions: the share of module tokens served from the store, TTFT p50/p95 of the
  corpus's questions and of full prefill, the speed-ups, bytes per tier against the budget; a plot.
- The run's module accesses replayed under each eviction policy (benchmarks/eviction_replay.py), at the run's
  budget and at `REPLAY_SCALES` times it: the served share a larger or smaller store would give.

Checks (`checks`, each passed True/False): `corpus_tokens` (at least `large_min_tokens`), `lazy_ingest`
(at least 10x faster than eager, store empty after it), and per run `served_steady` (the last window's
served share at least 0.9 of the first's), `speedup_vs_eager` (the last window's p50 speed-up at least 0.9
of the eager unlimited store's on the same questions), `budgets` (every tier within budget after every
question). The prefix cache is off: every token a question reuses comes from the store.

Not here: the small scenario's tiers and checks (sustained.py), the plot and table (sustained_report.py).
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import eviction_replay, real_text
from rag_promptcache.bench import redis_server
from rag_promptcache.bench.common import Bench
from rag_promptcache.engine.planning.costmodel import Fallback
from rag_promptcache.rag.budget import StoreBudget
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.sample import SampleDocument

TIER_SETS = ("memory+disk", "memory+redis")
REPLAY_SCALES = (1.0, 0.5, 2.0, 4.0)  # the run's budget times these, in the eviction replay
LAZY_TARGET = 10.0
STEADY = 0.9
LEADS = ("What does it say about", "Where is this described:", "Which document mentions", "Tell me about",
         "What is known of", "Explain")


@dataclass(frozen=True, slots=True)
class LargeConfig:
    """The run's sizes: a lazy corpus of real text, a store of 1/20 of its fp16 size."""

    large_tokens: int = 2_200_000  # gathered (about); the check wants `large_min_tokens` after ingest
    large_min_tokens: int = 2_000_000
    large_doc_root: str = "/usr/share/doc"
    large_chunk_tokens: int = 256
    large_eager_tokens: int = 40_000  # the slice ingested eagerly, for eager's rate
    large_k: int = 4
    large_questions: int = 1000
    large_warmup: int = 100
    large_every: int = 100
    large_full_every: int = 5  # full prefill and the eager unlimited store on every n-th question
    large_zipf: float = 1.0
    large_memory_share: float = 0.01  # of the corpus's fp16 KV
    large_shared_share: float = 0.04  # the disk tier's or Redis' (memory + this = 1/20)
    large_policy: str = "lru"
    large_tiers: tuple[str, ...] = ("memory+disk", "memory+redis")


def run(bench: Bench, cfg: LargeConfig = LargeConfig()) -> dict[str, object]:
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rpc-bench-large-")))
        text = real_text.gather(tmp / "text", cfg.large_tokens, Path(cfg.large_doc_root))
        bench.log(f"sustained large: gathered {sum(text.num_bytes.values()) / 2**20:.1f} MiB of text "
                  f"({text.num_documents})")
        # every process of the run: the store alone serves reused tokens
        stack.enter_context(_env("RAG_PROMPTCACHE_STORE_PREFIX_CACHE_BYTES", "0"))
        corpus, ingest = _ingest(bench, cfg, text.folder, tmp)
        docs = _documents(corpus)
        questions = stream(docs, cfg.large_warmup + cfg.large_questions, cfg.large_zipf)
        fp16 = corpus.table.counts()["num_tokens"] * _bytes_per_token(corpus, "fp16")
        budget = StoreBudget(memory=max(1, int(fp16 * cfg.large_memory_share)),
                             disk=max(1, int(fp16 * cfg.large_shared_share)),
                             redis=max(1, int(fp16 * cfg.large_shared_share)), policy=cfg.large_policy)
        out: dict[str, object] = {
            "text": {"bytes": text.num_bytes, "documents": text.num_documents}, "ingest": ingest,
            "corpus_tokens": corpus.table.counts()["num_tokens"], "modules": len(corpus), "fp16_bytes": fp16,
            "codec": corpus.manifest.codec, "budget": {"memory": budget.memory, "shared": budget.disk,
                                                       "policy": budget.policy},
            "k": cfg.large_k, "questions": cfg.large_questions, "warmup": cfg.large_warmup, "every": cfg.large_every,
            "full_every": cfg.large_full_every, "zipf": cfg.large_zipf, "runs": [],
        }
        corpus.close()
        for tiers in cfg.large_tiers:
            if tiers not in TIER_SETS:
                raise ValueError(f"unknown large tier set {tiers!r}; valid: {', '.join(TIER_SETS)}")
            if tiers.endswith("redis") and not redis_server.installed():
                out["runs"].append({"tiers": tiers, "skipped": redis_server.INSTALL_HINT})
                continue
            out["runs"].append(_run_tiers(bench, cfg, Path(corpus.path), tiers, budget, questions))
    out["checks"] = {
        "corpus_tokens": _check(out["corpus_tokens"] >= cfg.large_min_tokens,
                                f"{out['corpus_tokens']:,} tokens (>= {cfg.large_min_tokens:,})"),
        "lazy_ingest": _check(ingest["lazy_speedup"] >= LAZY_TARGET and ingest["store_bytes_after"] == 0,
                              f"lazy {ingest['lazy_speedup']:.1f}x faster than eager (>= {LAZY_TARGET}), store "
                              f"{ingest['store_bytes_after']} bytes after it"),
    }
    ran = [r for r in out["runs"] if "checks" in r]
    out["passed"] = all(c["passed"] for c in out["checks"].values()) and bool(ran) and all(
        c["passed"] for r in ran for c in r["checks"].values())
    return out


@contextlib.contextmanager
def _env(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None) if saved is None else os.environ.__setitem__(name, saved)


def _ingest(bench: Bench, cfg: LargeConfig, folder: Path, tmp: Path) -> tuple[Corpus, dict[str, object]]:
    """The lazy ingest of everything, timed; an eager ingest of a slice, timed, for the rate of eager."""
    from rag_promptcache.rag.loaders import load
    from rag_promptcache.store import DiskStore

    common = dict(model=bench.model_name, dtype=bench.config.dtype, adapter=bench.config.adapter, chunk_tokens=cfg.large_chunk_tokens,
                  progress=False, redis_url="")
    corpus = Corpus.build([folder], tmp / "corpus", kv="lazy", **common)
    lazy = corpus.last_report
    disk = DiskStore(tmp / "corpus" / "store")
    after = disk.stats().num_bytes
    disk.close()
    docs = list(load([folder]))
    rng = random.Random(7)
    rng.shuffle(docs)
    picked, size = [], 0
    for d in docs:  # a slice of every kind, by about its share of the corpus
        if size >= cfg.large_eager_tokens * real_text.BYTES_PER_TOKEN:
            break
        picked.append(SampleDocument("".join(d.blocks()), {"source": d.source}))
        size += d.num_bytes
    eager = Corpus.build(picked, tmp / "eager", embedder=corpus.embedder, **common)
    er = eager.last_report
    eager.close()
    assert lazy is not None and er is not None, f"{lazy=} {er=}"
    eager_s = lazy.num_tokens / er.tokens_per_s if er.tokens_per_s else float("inf")
    out = {"lazy_seconds": lazy.seconds, "lazy_tokens": lazy.num_tokens, "lazy_modules": lazy.num_modules,
           "lazy_tokens_per_s": lazy.tokens_per_s, "store_bytes_after": after,
           "encoded_after": corpus.coverage().num_encoded, "eager_slice_tokens": er.num_tokens,
           "eager_slice_seconds": er.seconds, "eager_tokens_per_s": er.tokens_per_s,
           "eager_seconds_estimate": eager_s, "lazy_speedup": eager_s / lazy.seconds if lazy.seconds else 0.0}
    bench.log(f"sustained large: lazy ingest of {lazy.num_tokens:,} tokens ({lazy.num_modules} modules) in "
              f"{lazy.seconds:.0f} s; eager {er.tokens_per_s:.0f} tokens/s on a {er.num_tokens:,}-token slice: "
              f"{eager_s:.0f} s for the whole, lazy {out['lazy_speedup']:.1f}x faster; store {after} bytes after")
    return corpus, out


def _documents(corpus: Corpus) -> list[str]:
    """Each document's text (its chunks, overlap and all), in table order."""
    texts: dict[str, list[str]] = {}
    for doc, _, _ in corpus.table.document_chunks():
        texts.setdefault(doc.source, [])
    for m, _ in corpus.table.modules():
        for source, _, _ in corpus.table.sources(m):
            texts.setdefault(source, []).append(corpus.text(m))
    return [" ".join(t) for t in texts.values() if t]


def stream(docs: list[str], count: int, zipf: float, seed: int = 42) -> list[tuple[int, str]]:
    """`count` questions: (document, text), documents drawn by Zipf over a random popularity order, each
    text a few words of its document after a lead-in, none repeated."""
    rng = np.random.default_rng(seed)
    ranks = rng.permutation(len(docs))
    weights = 1.0 / (ranks + 1.0) ** zipf
    picks = rng.choice(len(docs), size=count, p=weights / weights.sum())
    words, seen, out = random.Random(seed), set(), []
    for d in picks:
        tokens = docs[d].split()
        while True:
            n = words.randint(6, 12)
            start = words.randrange(max(1, len(tokens) - n))
            text = f"{words.choice(LEADS)} {' '.join(tokens[start:start + n])}?"
            if text not in seen:
                break
        seen.add(text)
        out.append((int(d), text))
    return out


def _bytes_per_token(corpus: Corpus, codec: str) -> float:
    from rag_promptcache.store.codecs import bytes_per_token

    engine = corpus.engine_slot.get()
    g = engine.geometry
    return bytes_per_token(codec, (g.num_layers, g.num_kv_heads, g.head_dim), engine.model.dtype,
                           corpus.manifest.chunk_tokens)


def _run_tiers(bench: Bench, cfg: LargeConfig, path: Path, tiers: str, budget: StoreBudget,
               questions: list[tuple[int, str]]) -> dict[str, object]:
    import shutil

    from benchmarks.sustained_report import summarize

    shutil.rmtree(path / "store", ignore_errors=True)
    with contextlib.ExitStack() as stack:
        url = ""
        if tiers.endswith("redis"):
            url = stack.enter_context(redis_server.LocalRedis()).url
        corpus = Corpus.open(path, redis_url=url, disk_tier=not url)
        stack.callback(corpus.close)
        corpus.set_budget(budget)
        engine = corpus.prepare()
        # the cached path always: this measures what the store serves, not the planner's choice of path (on a
        # loaded machine the timed cost model may run short prompts as full prefill, and serve nothing)
        engine.fallback = Fallback("never")
        keys = {m: (key, n) for m, key, n in corpus.table.module_keys()}
        per_token = _bytes_per_token(corpus, corpus.manifest.codec)
        rows, trace = [], []
        bench.log(f"sustained large {tiers}: {len(questions)} questions, budget {budget.describe()}")
        t0 = time.perf_counter()
        for i, (_, q) in enumerate(questions):
            ans = corpus.ask(q, k=cfg.large_k, max_new_tokens=1)
            engine.background.wait_done()  # a user's pause: the question's deferred misses are stored before the next
            hit = set(ans.hit_modules)
            row = {"question": i, "cached_s": ans.ttft_s, "path": ans.path,
                   "module_tokens": sum(keys[m][1] for m in ans.module_ids),
                   "served_tokens": sum(keys[m][1] for m in ans.module_ids if m in hit),
                   "hits": len(hit), "misses": len(ans.missed_modules), "tiers": _sample(engine.store),
                   "full_s": None, "eager_s": None}
            if i % cfg.large_full_every == 0:
                row["full_s"] = engine.generate(ans.prompt, use_cache=False, max_new_tokens=1).ttft_s
                row["eager_s"] = _eager_ttft(corpus, engine, ans)
            rows.append(row)
            trace.append([(keys[m][0], int(keys[m][1] * per_token) + 1024, keys[m][1]) for m in ans.module_ids])
            if (i + 1) % cfg.large_every == 0:
                recent = rows[-cfg.large_every:]
                bench.log(f"sustained large {tiers}: {i + 1}/{len(questions)} in {time.perf_counter() - t0:.0f} s; "
                          f"served {sum(r['served_tokens'] for r in recent) / max(1, sum(r['module_tokens'] for r in recent)):.3f}"
                          f", encoded {corpus.coverage().num_encoded} modules")
        limits = {"memory": budget.memory, "disk" if not url else "redis": budget.disk}
        replayed = {scale: eviction_replay.compare(trace, [int(budget.memory * scale), int(budget.disk * scale)],
                                                   cfg.large_every, cfg.large_warmup) for scale in REPLAY_SCALES}
        return summarize(tiers, rows, limits, cfg.large_warmup, cfg.large_every, replayed, corpus.coverage())


def _sample(store) -> dict[str, dict[str, int]]:
    out = {}
    for tier in getattr(store, "tiers", [store]):
        name = type(tier).__name__.removesuffix("Store").lower()
        s = tier.stats()
        held = tier.budget.total() if name == "redis" and getattr(tier, "budget", None) else s.num_bytes
        out[name] = {"bytes": held, "entries": s.num_entries}
    return out


def _eager_ttft(corpus: Corpus, engine, ans) -> float:
    """The TTFT of the same prompt on a fully eager fp16 corpus with an unlimited store: every module a
    memory hit in fp16. Its modules go into a fresh store first, untimed: copied from the corpus's store,
    which the question just filled (encoded where a tier already dropped one)."""
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.engine.prompt.compiler import ROOT
    from rag_promptcache.rag.encoding import corpus_schema
    from rag_promptcache.store import MemoryStore

    ref = getattr(corpus, "_eager_ref", None)
    if ref is None:
        ref = PromptCache(engine.model, engine.tokenizer, store=MemoryStore(codec="fp16"), mode=engine.mode,
                          recovery=str(engine.recovery), prefix_cache_bytes=0, name=engine.model_name, fallback="never")
        corpus._eager_ref = ref  # type: ignore[attr-defined]
    ref.store.close()  # only this question's modules: the store of a corpus that holds every one
    modules = [(m, corpus.table.module(m)[0]) for m in ans.module_ids]
    ref.add_schema(corpus_schema(corpus.manifest, modules), replace=True)
    name = corpus.manifest.name
    keys = ref.store_keys(name, [ROOT, *(m for m, _ in modules)])
    for key in keys.values():
        kv = engine.store.get(key)
        if kv is not None:
            ref.store.put(key, kv)
    ref.encode(name)  # what no tier held any more
    return ref.generate(ans.prompt, max_new_tokens=1).ttft_s


def _check(passed: bool, detail: str) -> dict[str, object]:
    return {"passed": bool(passed), "detail": detail}


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> dict[str, object]:
    from benchmarks import harness, sustained_report

    ap = harness.parser("The sustained run at real size: a lazy corpus of about 2M tokens of this machine's text, a store "
                        "of 1/20 of its fp16 size, 1000 novel questions (hours on two CPU cores). sustained_large.json, "
                        ".md and the plot in --out.")
    ap.add_argument("--tokens", type=int, default=LargeConfig.large_tokens, help="the corpus's tokens, gathered (about)")
    ap.add_argument("--questions", type=int, default=LargeConfig.large_questions, help="measured, after the warm-up")
    args = ap.parse_args(argv)
    cfg = LargeConfig(large_tokens=args.tokens, large_min_tokens=min(args.tokens, LargeConfig.large_min_tokens),
                      large_questions=args.questions)
    bench = harness.load(args)
    out = run(bench, cfg)
    written = harness.write(bench, args.quick, args.out, "sustained_large", out, "\n".join(sustained_report.markdown(out)))
    sustained_report.plots(out, args.out)
    return written


if __name__ == "__main__":
    main()
