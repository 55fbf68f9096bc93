"""Serving throughput on Ray Serve: 1 and 2 replicas of `serve --ray`, 8 concurrent openai clients.

    python -m benchmarks.replicas --out docs/bench/replicas-DATE

Builds a corpus of the default model (SmolLM2) over the short documents of the Python reference slice
(`rag.sample`, those of at most `--doc-tokens` tokens) in a temporary folder (deleted at the end), or
takes `--corpus`. Then for each replica count, in rounds (1, 2, 1, 2 by default: each count sees the
machine's load of the moment about as often): a local Ray cluster and the deployment that `serve --ray` makes
(`server.ray_serve.serve_ray`), the machine's cores split evenly between the replicas (Ray gives each
replica as many torch threads as CPUs), a warm-up pass that is not timed (each module into the corpus
store, the replicas' first forwards), then 8 threads, each an `openai` client with streaming off,
asking `--per-client` questions one after another: greedy, `--max-tokens` tokens each (`ignore_eos`).
Aggregate completion tokens/s and requests/s over the wall time, and which replicas answered
(`x-replica`). Every timed request is a question not asked before (the client and request number
follow it): an exact repeat would skip its prefill (docs/serving.md), and more often on one replica,
which sees every earlier request, than on two. Writes bench.json (every run) and bench.md (the table)
into `--out`.

Not here: streaming latency (the `serve` scenario of the bench), several machines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from rag_promptcache.bench.tables import table

CLIENTS = 8
QUESTIONS = (
    "How do break and continue behave inside a for loop?",
    "What does the pass statement do?",
    "What does the global statement declare?",
    "How is a nonlocal name resolved?",
    "What does the del statement do to a name?",
    "What does a lambda expression create?",
    "When does an assert statement do nothing?",
    "What values are considered false in a truth value test?",
)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for bench.json and bench.md")
    ap.add_argument("--corpus", type=Path, help="an existing corpus [default: build one in a temporary folder]")
    ap.add_argument("--doc-tokens", type=int, default=300, help="the built corpus keeps documents up to this long")
    ap.add_argument("--replicas", default="1,2,1,2", help="replica counts, in the order they run")
    ap.add_argument("--per-client", type=int, default=8, help="requests each of the 8 clients makes")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--redis-url", default="", help="the replicas' shared tier [default: none, the corpus's disk store]")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.replicas.split(",")]
    if not counts or min(counts) < 1:
        raise SystemExit(f"--replicas takes counts of at least 1, like 1,2, not {args.replicas!r}")

    cores = os.cpu_count() or 1
    corpus, built = (args.corpus, {}) if args.corpus else _build(args.doc_tokens)
    try:
        runs = [_run(corpus, n, cores / n, args) for n in counts]
    finally:
        if not args.corpus:
            shutil.rmtree(corpus.parent, ignore_errors=True)
    best = {n: max((r for r in runs if r["replicas"] == n), key=lambda r: r["tokens_per_s"]) for n in sorted(set(counts))}
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cores": cores, "clients": CLIENTS,
           "per_client": args.per_client, "max_tokens": args.max_tokens, "corpus": str(args.corpus or "built"),
           **built, "redis": bool(args.redis_url), "runs": runs,
           "best_tokens_per_s": {str(n): r["tokens_per_s"] for n, r in best.items()}}
    if 1 in best and 2 in best:
        out["ratio_2_vs_1"] = round(best[2]["tokens_per_s"] / best[1]["tokens_per_s"], 3)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench.json").write_text(json.dumps(out, indent=1) + "\n")
    (args.out / "bench.md").write_text(_markdown(out))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}), flush=True)
    return out


def _build(doc_tokens: int) -> tuple[Path, dict[str, object]]:
    from rag_promptcache.model.loading import load_tokenizer
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.sample import sample_documents

    tok = load_tokenizer()
    sized = [(d, len(tok(d.page_content).input_ids)) for d in sample_documents()]
    docs = [d for d, n in sized if n <= doc_tokens]
    path = Path(tempfile.mkdtemp(prefix="rag-promptcache-replicas-")) / "docs"
    t0 = time.perf_counter()
    Corpus.build(docs, path, progress=False, redis_url="").close()
    return path, {"corpus_documents": len(docs), "corpus_tokens": sum(n for _, n in sized if n <= doc_tokens),
                  "corpus_build_s": round(time.perf_counter() - t0, 1)}


def _run(corpus: Path, replicas: int, cpus: float, args: argparse.Namespace) -> dict[str, object]:
    from rag_promptcache.bench.serve import free_port
    from rag_promptcache.server.ray_serve import ReplicaOptions, serve_ray

    port = free_port()
    ready, stop, failed = threading.Event(), threading.Event(), []

    def deploy() -> None:
        try:
            serve_ray(corpus, replicas=replicas, port=port, cpus_per_replica=cpus, ready=ready, stop=stop,
                      opts=ReplicaOptions(str(Path(corpus).resolve()), redis_url=args.redis_url), log=print)
        except BaseException as e:  # re-raised below, in the bench's thread
            failed.append(e)
            ready.set()

    thread = threading.Thread(target=deploy, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    ready.wait()
    if failed:
        raise failed[0]
    started_s = time.perf_counter() - t0
    base, model = f"http://127.0.0.1:{port}/v1", Path(corpus).resolve().name
    try:
        for _ in range(2):  # warm-up, not timed: every replica loads the modules, runs its first forwards
            _clients(base, model, 1, 1, tag="warm-up")
        load_before = os.getloadavg()[0]
        result = _clients(base, model, args.per_client, args.max_tokens, tag="timed")
        load_after = os.getloadavg()[0]
    finally:
        stop.set()
        thread.join(120)
    row = {"replicas": replicas, "cpus_per_replica": cpus, "start_s": round(started_s, 1), **result,
           "load_before": round(load_before, 2), "load_after": round(load_after, 2)}
    print(json.dumps(row), flush=True)
    return row


def _clients(base: str, model: str, per_client: int, max_tokens: int, tag: str) -> dict[str, object]:
    """CLIENTS threads, each an openai client asking `per_client` questions in turn, each one new; the aggregate."""
    import openai

    answered: Counter[str] = Counter()
    tokens: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        api = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
        try:
            for j in range(per_client):
                raw = api.chat.completions.with_raw_response.create(
                    model=model, messages=[{"role": "user", "content": f"{QUESTIONS[(i + j) % len(QUESTIONS)]} "
                                                                       f"({tag} {time.time_ns()}, client {i}, request {j})"}],
                    max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
                with lock:
                    answered[raw.headers["x-replica"]] += 1
                    tokens.append(raw.parse().usage.completion_tokens)
        except BaseException as e:  # re-raised below, after every thread is done
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"requests": len(tokens), "completion_tokens": sum(tokens), "wall_s": round(wall, 2),
            "tokens_per_s": round(sum(tokens) / wall, 2), "requests_per_s": round(len(tokens) / wall, 3),
            "answered_by": sorted(answered.values(), reverse=True)}


def _markdown(out: dict[str, object]) -> str:
    rows = [[r["replicas"], f"{r['cpus_per_replica']:g}", r["requests"], r["wall_s"], r["tokens_per_s"],
             r["requests_per_s"], " / ".join(map(str, r["answered_by"])), f"{r['load_before']} → {r['load_after']}"]
            for r in out["runs"]]
    corpus = (f"{out['corpus_documents']} documents of the Python reference slice, {out['corpus_tokens']} tokens, "
              f"built in {out['corpus_build_s']} s" if out["corpus"] == "built" else f"`{out['corpus']}`")
    ratio = f"\n2 replicas against 1, best run of each: **{out['ratio_2_vs_1']}x** tokens/s.\n" if "ratio_2_vs_1" in out else ""
    return (f"# Ray Serve replicas, {out['clients']} clients\n\n"
            f"{out['date']}, {out['cores']} CPU cores; SmolLM2 (the default model and dtype); {out['clients']} openai "
            f"clients, streaming off, {out['per_client']} requests each, {out['max_tokens']} completion tokens each; "
            f"Redis tier: {'yes' if out['redis'] else 'no (the corpus disk store)'}; corpus: {corpus}. "
            "Every timed request is a new question. Runs in the order they ran.\n\n"
            + table(["replicas", "CPUs each", "requests", "wall s", "completion tokens/s", "requests/s",
                     "answered per replica", "load average 1 min (before → after)"], rows) + "\n" + ratio)


if __name__ == "__main__":
    main()
