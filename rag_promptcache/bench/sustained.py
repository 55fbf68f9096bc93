"""Steady speed under a stream of novel questions, with every tier smaller than the corpus (issue 42 §2).

LMCache's CacheBlend store, keyed by prefix chains, floods under novel RAG questions and evicts its warm
chunks: reuse decays to about 1x within 60-90 of them (LMCache issue #4663). Modules here are content
addressed, so a new combination of stored chunks adds no entry. This scenario shows it under budgets:

- a corpus of `sustained_modules` modules of `sustained_module_tokens` tokens (the pydoc topics), ingested
  first (every module encoded and stored, as `ingest` does);
- tier sets, each with a fresh engine: `memory` alone, `memory+disk`, `memory+redis` (a redis-server the
  bench starts on a free loopback port; skipped, with the reason, where none is installed). The memory
  tier's budget is `sustained_memory_share` of the corpus's bytes; the disk tier's `sustained_shared_share`,
  and Redis' maxmemory that share above what the empty server holds, with room for its buffers
  (volatile-lru over entries with a TTL, so the store's index stays);
  the prefix cache holds `sustained_prefix_prompts` prompts;
- `sustained_warmup` + `sustained_questions` questions, each a new text, each importing k modules drawn
  without replacement by a Zipf popularity (exponent `sustained_zipf`) over the corpus. Retrieval is
  simulated: what a store sees of a retriever is this access pattern;
- prefill only: the first token of each, the cached plan every question (`fallback="never"`: this measures
  the store's reuse, not the planner's choice of path, which on a tiny model follows the clock's noise),
  the engine's full prefill of the same tokens every `sustained_full_every`-th.

Checks (`checks`, each passed True/False, or None where this run cannot judge it):
- `speedup_steady`: the speed-up over full prefill of the last `sustained_window` questions is at least
  `STEADY` of the first window's after warm-up (judged where each window's cached TTFT adds up to
  `sustained_judge_s`, so a clock that steps by tens of milliseconds cannot decide it);
- `reuse_steady`: the same for the share of prompt tokens served from caches (no clock);
- `budgets`: every tier's bytes within its budget after ingest and after every question;
- `entries`: no tier ever holds more entries than the corpus has modules (and the schema's root);
- `prefix`: the prefix cache's bytes within its budget, its nodes no more than the tokens that fit.

Not here: answers (fidelity.py); the plots and the table (`markdown`, `plots` below format what `run`
measured).
"""

from __future__ import annotations

import contextlib
import random
import tempfile
import uuid
from pathlib import Path

import numpy as np

from rag_promptcache.bench import redis_server
from rag_promptcache.bench.common import Bench, fit_question, module_texts, schema_pml
from rag_promptcache.bench.tables import table
from rag_promptcache.engine import PromptCache
from rag_promptcache.model.positions import kv_geometry
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.store import DiskStore, MemoryStore, RedisStore, Store, TieredStore

SCHEMA = "bench_sustained"
TIER_SETS = ("memory", "memory+disk", "memory+redis")
QUERY_TOKENS = 32
STEADY = 0.9
TTL_S = 86_400.0  # entries expire only so that Redis' volatile-lru may evict them, never its index
REDIS_HEADROOM = 256 * 2**10


def stream(bench: Bench, num_modules: int) -> list[tuple[list[str], str]]:
    """The questions: (modules imported, best last; a question text no other question has)."""
    cfg, tok = bench.config, bench.tokenizer
    rng = np.random.default_rng(42)
    ranks = rng.permutation(num_modules)  # module i has popularity rank ranks[i]
    weights = 1.0 / (ranks + 1.0) ** cfg.sustained_zipf
    weights /= weights.sum()
    words = random.Random(42)
    vocab = QUESTION_WORDS.split()
    out = []
    for i in range(cfg.sustained_warmup + cfg.sustained_questions):
        picked = rng.choice(num_modules, size=cfg.sustained_k, replace=False, p=weights)
        text = f"Question {i}: " + " ".join(words.choice(vocab) for _ in range(12)) + "?"
        out.append(([f"d{j}" for j in picked], fit_question(tok, text, QUERY_TOKENS)))
    return out


QUESTION_WORDS = ("how why when which where does can the a this that statement keyword loop function class "
                  "object value name scope import module exception error raise return yield await async with "
                  "context manager iterator generator list dict set tuple string number operator comparison "
                  "assignment expression evaluation order default argument attribute method inherit override")


def run(bench: Bench) -> dict[str, object]:
    cfg, tok = bench.config, bench.tokenizer
    texts = module_texts(tok, cfg.sustained_modules, cfg.sustained_module_tokens)
    schema = schema_pml(SCHEMA, {f"d{i}": t for i, t in enumerate(texts)})
    g = kv_geometry(bench.model)
    bytes_per_token = 2 * g.num_layers * g.num_kv_heads * g.head_dim * bench.model.dtype.itemsize
    corpus_bytes = len(texts) * cfg.sustained_module_tokens * bytes_per_token
    questions = stream(bench, len(texts))
    out: dict[str, object] = {
        "modules": len(texts), "module_tokens": cfg.sustained_module_tokens, "k": cfg.sustained_k,
        "questions": cfg.sustained_questions, "warmup": cfg.sustained_warmup, "window": cfg.sustained_window,
        "zipf": cfg.sustained_zipf, "full_every": cfg.sustained_full_every, "corpus_bytes": corpus_bytes,
        "memory_share": cfg.sustained_memory_share, "shared_share": cfg.sustained_shared_share,
        "every": cfg.sustained_every, "runs": [],
    }
    prompt_tokens = cfg.sustained_k * cfg.sustained_module_tokens + QUERY_TOKENS
    prefix_bytes = int(cfg.sustained_prefix_prompts * prompt_tokens * bytes_per_token)
    for tiers in cfg.sustained_tiers:
        if tiers not in TIER_SETS:
            raise ValueError(f"unknown sustained tier set {tiers!r}; valid: {', '.join(TIER_SETS)}")
        if tiers.endswith("redis") and not redis_server.installed():
            out["runs"].append({"tiers": tiers, "skipped": redis_server.INSTALL_HINT})
            bench.log(f"sustained {tiers}: skipped ({redis_server.INSTALL_HINT})")
            continue
        with contextlib.ExitStack() as stack:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rpc-bench-sustained-")))
            budgets = {"memory": int(cfg.sustained_memory_share * corpus_bytes)}
            shared = int(cfg.sustained_shared_share * corpus_bytes)
            tier_list: list[Store] = [MemoryStore(max_bytes=budgets["memory"])]
            redis_probe = None
            if tiers.endswith("disk"):
                budgets["disk"] = shared
                tier_list.append(DiskStore(tmp, max_bytes=shared))
            elif tiers.endswith("redis"):
                server = stack.enter_context(redis_server.LocalRedis("--maxmemory-policy", "volatile-lru"))
                tier_list.append(RedisStore(server.url, prefix=uuid.uuid4().hex[:8], ttl_s=TTL_S))
                redis_probe = RedisProbe(server.url, shared, tier_list[-1])
                budgets["redis"] = redis_probe.max_bytes
            store = TieredStore(tier_list)
            stack.callback(store.close)
            options = {k: v for k, v in bench.engine_options.items() if k != "prefix_cache_bytes"}
            pc = PromptCache(bench.model, tok, store=store, name=bench.model_name, prefix_cache_bytes=prefix_bytes,
                             fallback="never", **options)
            pc.add_schema(schema)
            ingest = pc.encode(SCHEMA)
            bench.log(f"sustained {tiers}: ingested {ingest.num_modules} modules ({ingest.num_tokens} tokens, "
                      f"{corpus_bytes / 2**20:.1f} MiB) in {ingest.seconds:.1f} s; budgets "
                      + ", ".join(f"{n} {b / 2**20:.1f} MiB" for n, b in budgets.items()))
            out["runs"].append(_stream(bench, pc, store, redis_probe, questions, tiers, budgets, prefix_bytes,
                                       len(texts), bytes_per_token))
    ran = [r for r in out["runs"] if "checks" in r]
    out["passed"] = bool(ran) and all(c["passed"] is not False for r in ran for c in r["checks"].values())
    return out


class RedisProbe:
    """What the bench's own Redis holds, read by INFO. Its maxmemory is what the empty server uses with the
    store's client connected, plus `entries_bytes` (so the tier's share compares with the other tiers'),
    plus `REDIS_HEADROOM` for its own buffers (a command's arguments count while it runs)."""

    def __init__(self, url: str, entries_bytes: int, store: RedisStore) -> None:
        import redis

        self.client = redis.Redis.from_url(url)
        store.contains("connect")  # its connection's buffers are part of what the empty server uses
        self.max_bytes = int(self.client.info("memory")["used_memory"]) + entries_bytes + REDIS_HEADROOM
        self.client.config_set("maxmemory", self.max_bytes)

    def used_bytes(self) -> int:
        return int(self.client.info("memory")["used_memory"])  # the command itself evicts first, as any does

    def entries(self) -> int:
        """Entries the server holds now (the store's own index keeps what Redis evicted until a get)."""
        return sum(1 for _ in self.client.scan_iter(match="*:kv:*", count=1000))


def _sample(store: TieredStore, redis_probe: RedisProbe | None, pc: PromptCache) -> dict[str, object]:
    tiers = {}
    for name, tier, s in zip(("memory", "shared"), store.tiers, store.tier_stats()):
        name = name if name == "memory" else ("disk" if isinstance(tier, DiskStore) else "redis")
        held = redis_probe.used_bytes() if redis_probe and name == "redis" else s.num_bytes
        entries = redis_probe.entries() if redis_probe and name == "redis" else s.num_entries
        tiers[name] = {"bytes": held, "entries": entries, "hits": s.num_hits, "misses": s.num_misses}
    p = pc.prefix_cache.stats()
    return {"tiers": tiers, "prefix": {"nodes": p.num_nodes, "tokens": p.num_tokens, "bytes": p.num_bytes}}


def _stream(bench: Bench, pc: PromptCache, store: TieredStore, redis_probe: RedisProbe | None,
            questions: list[tuple[list[str], str]], tiers: str, budgets: dict[str, int], prefix_bytes: int,
            num_modules: int, bytes_per_token: int) -> dict[str, object]:
    cfg = bench.config
    rows = []
    after_ingest = _sample(store, redis_probe, pc)
    for i, (modules, question) in enumerate(questions):
        prompt = prompt_pml(SCHEMA, modules, [("user", question)])
        res = pc.generate(prompt, max_new_tokens=1)
        full = (pc.generate(prompt, use_cache=False, max_new_tokens=1).ttft_s
                if i % cfg.sustained_full_every == 0 else None)
        rows.append({"question": i, "cached_s": res.ttft_s, "full_s": full, "hits": len(res.hit_modules),
                     "misses": len(res.missed_modules), "prompt_tokens": res.prompt_tokens,
                     "cached_tokens": res.cached_tokens, "path": res.path, **_sample(store, redis_probe, pc)})
        if (i + 1) % max(1, len(questions) // 10) == 0:
            recent = rows[-cfg.sustained_every:]
            bench.log(f"sustained {tiers}: {i + 1}/{len(questions)} questions; last {len(recent)}: cached "
                      f"{sum(r['cached_s'] for r in recent) / len(recent):.3f} s, modules hit "
                      f"{sum(r['hits'] for r in recent)}/{sum(r['hits'] + r['misses'] for r in recent)}")
    w, start = cfg.sustained_window, cfg.sustained_warmup
    first, last = window(rows[start:start + w]), window(rows[-w:])
    samples = [after_ingest, *rows]
    checks = {
        "speedup_steady": _steady(first["speedup"], last["speedup"],
                                  min(first["cached_s_sum"], last["cached_s_sum"]) >= cfg.sustained_judge_s),
        "reuse_steady": _steady(first["served_share"], last["served_share"], True),
        "budgets": _within([(f"{n} after sample {j}", t["bytes"], budgets[n]) for j, s in enumerate(samples)
                            for n, t in s["tiers"].items()]),
        "entries": _within([(f"{n} after sample {j}", t["entries"], num_modules + 1) for j, s in enumerate(samples)
                            for n, t in s["tiers"].items()]),
        "prefix": _within([(f"prefix bytes after question {r['question']}", r["prefix"]["bytes"], prefix_bytes)
                           for r in rows] + [(f"prefix nodes after question {r['question']}", r["prefix"]["nodes"],
                                              prefix_bytes // bytes_per_token) for r in rows]),
    }
    run = {"tiers": tiers, "budgets": budgets, "prefix_budget": prefix_bytes, "first": first, "last": last,
           "checks": checks, "rows": rows, "after_ingest": after_ingest}
    bench.log(f"sustained {tiers}: speed-up first {first['speedup']} last {last['speedup']}; served share "
              f"{first['served_share']:.3f} -> {last['served_share']:.3f}; checks "
              + ", ".join(f"{n} {c['passed']}" for n, c in checks.items()))
    return run


def window(rows: list[dict[str, object]]) -> dict[str, object]:
    """One window's numbers: means of quantized times are unbiased where single times are not."""
    timed = [r["full_s"] for r in rows if r["full_s"] is not None]
    cached = sum(r["cached_s"] for r in rows)
    full_mean = sum(timed) / len(timed) if timed else None
    cached_mean = cached / len(rows) if rows else None
    return {
        "questions": [rows[0]["question"], rows[-1]["question"]] if rows else [],
        "cached_s_mean": cached_mean, "full_s_mean": full_mean, "cached_s_sum": cached,
        "speedup": full_mean / cached_mean if full_mean and cached_mean else None,
        "served_share": sum(r["cached_tokens"] for r in rows) / max(1, sum(r["prompt_tokens"] for r in rows)),
        "module_hit_rate": sum(r["hits"] for r in rows) / max(1, sum(r["hits"] + r["misses"] for r in rows)),
        "full_path": sum(r["path"] == "full" for r in rows),
    }


def _steady(first: float | None, last: float | None, judged: bool) -> dict[str, object]:
    if not judged or first is None or last is None:
        return {"passed": None, "detail": "not judged: a window's cached TTFT adds up to less than sustained_judge_s"}
    ratio = last / first if first else float("inf")
    return {"passed": ratio >= STEADY, "detail": f"last {last:.3f} / first {first:.3f} = {ratio:.3f} (>= {STEADY})",
            "ratio": ratio}


def _within(points: list[tuple[str, int, int]]) -> dict[str, object]:
    over = [f"{what}: {value} > {limit}" for what, value, limit in points if value > limit]
    worst = max(points, key=lambda p: p[1] / max(p[2], 1))
    return {"passed": not over, "detail": "; ".join(over[:3]) or f"highest {worst[1]} of {worst[2]} ({worst[0]})"}


def hit_rates(rows: list[dict[str, object]], every: int) -> list[dict[str, object]]:
    """Per block of `every` questions: each tier's own hit rate (of the gets that reached it) and the
    share of modules served from any tier."""
    out = []
    for b in range(0, len(rows) - every + 1, every):
        block, before = rows[b:b + every], rows[b - 1] if b else None
        point: dict[str, object] = {"question": block[-1]["question"],
                                    "any": sum(r["hits"] for r in block) / max(1, sum(r["hits"] + r["misses"] for r in block))}
        for name, t in block[-1]["tiers"].items():
            h0 = before["tiers"][name]["hits"] if before else 0
            m0 = before["tiers"][name]["misses"] if before else 0
            gets = t["hits"] - h0 + t["misses"] - m0
            point[name] = (t["hits"] - h0) / gets if gets else None
        out.append(point)
    return out


def markdown(report: dict[str, object]) -> list[str]:
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    rows = []
    for r in report["runs"]:
        if "skipped" in r:
            rows.append([r["tiers"], f"skipped: {r['skipped']}"] + [""] * 9)
            continue
        f, la, c = r["first"], r["last"], r["checks"]
        peak = {n: max(s["tiers"][n]["bytes"] for s in (r["after_ingest"], *r["rows"])) for n in r["budgets"]}
        rows.append([r["tiers"], ", ".join(f"{n} {mib(peak[n])}/{mib(b)}" for n, b in r["budgets"].items()),
                     _num(f["speedup"]), _num(la["speedup"]), f"{f['served_share']:.3f}", f"{la['served_share']:.3f}",
                     f"{f['module_hit_rate']:.3f}", f"{la['module_hit_rate']:.3f}",
                     max(s["prefix"]["nodes"] for s in r["rows"]),
                     f"{mib(max(s['prefix']['bytes'] for s in r['rows']))}/{mib(r['prefix_budget'])}",
                     ", ".join(f"{n} {'pass' if v['passed'] else 'n/a' if v['passed'] is None else 'FAIL'}"
                               for n, v in c.items())])
    return [f"## Sustained: {report['questions']} novel questions after {report['warmup']} of warm-up, k={report['k']}, "
            f"{report['modules']} modules of {report['module_tokens']} tokens ({mib(report['corpus_bytes'])} MiB), "
            f"Zipf {report['zipf']}", "", table(
                ["tiers", "peak / budget MiB", f"speed-up first {report['window']}", f"speed-up last {report['window']}",
                 "served share first", "served share last", "modules hit first", "modules hit last",
                 "prefix nodes max", "prefix MiB max/budget", "checks"], rows), "",
            f"all checks passed: {'yes' if report['passed'] else 'NO'}", ""]


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def plots(report: dict[str, object], folder: Path) -> list[Path]:
    from rag_promptcache.bench.tables import grid, save

    runs = [r for r in report["runs"] if "rows" in r]
    if not runs:
        return []
    every = max(1, report.get("every", 10))
    fig, axes = grid(len(runs), 2, 12, 3.6)
    for (left, right), r in zip(axes, runs):
        points = hit_rates(r["rows"], every)
        xs = [p["question"] + 1 for p in points]
        for name in ("any", *r["budgets"]):
            ys = [p.get(name) for p in points]
            left.plot(xs, [float("nan") if y is None else y for y in ys], marker=".",
                      label="modules from any tier" if name == "any" else f"{name} tier's own gets")
        left.set(ylim=(0, 1.02), xlabel="question", ylabel="hit rate", title=f"{r['tiers']}: hit rate per {every} questions")
        blocks = [r["rows"][b:b + every] for b in range(0, len(r["rows"]) - every + 1, every)]
        speed = [window(b)["speedup"] for b in blocks]
        right.plot(xs, [float("nan") if s is None else s for s in speed], marker=".", label="speed-up over full prefill")
        right.set(xlabel="question", ylabel="speed-up (x)", title=f"{r['tiers']}: TTFT speed-up per {every} questions")
        for ax in (left, right):
            ax.axvline(report["warmup"] + 0.5, color="grey", linestyle="--", linewidth=0.8)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    return [save(fig, Path(folder) / "sustained.png")]
