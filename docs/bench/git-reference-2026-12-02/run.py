"""A real reference of about a million tokens ingested lazily, as a user would: Git's HTML manual
(Debian's git-doc, every `.html` file under /usr/share/doc/git-doc; `make manuals` installs it), the
corpus's defaults (k = 4, its default budget, misses computed in the request and stored by the background
encoder while no request runs, the default fallback). Measured: the ingest's time, the store's size after
it and after the questions, and each question's TTFT against the engine's own full prefill of the same
prompt (run right after it). The questions are a user's: "What does git NAME do?" for the manual's pages
in a shuffled order, then some asked again; between questions the background encoder gets up to `think`
seconds (a user reading the answer).

Run from the repository root: python docs/bench/git-reference-2026-12-02/run.py OUT.json [questions] [think]
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rag_promptcache.rag.corpus import Corpus

MANUAL = Path("/usr/share/doc/git-doc")
REPEAT = 0.2  # the share of questions asked again later (a user's second look)


def bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def questions(pages: list[Path], count: int) -> list[str]:
    names = sorted(p.stem.removeprefix("git-") for p in pages if p.stem.startswith("git-"))
    rng = random.Random(11)
    rng.shuffle(names)
    fresh = [f"What does git {n} do?" for n in names[:int(count * (1 - REPEAT))]]
    again = rng.sample(fresh, count - len(fresh))
    out = fresh + again
    rng.shuffle(out[len(fresh) // 2:])  # the repeats among the second half
    return out[:count]


def main() -> None:
    out = Path(sys.argv[1])
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 100
    think = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
    pages = sorted(MANUAL.glob("*.html"))
    with tempfile.TemporaryDirectory(prefix="rpc-git-reference-") as tmp:
        folder = Path(tmp) / "git-doc"
        folder.mkdir()
        for p in pages:
            shutil.copy(p, folder / p.name)
        t0 = time.perf_counter()
        corpus = Corpus.build([folder], Path(tmp) / "corpus", kv="lazy", progress=False, redis_url="")
        ingest_s = time.perf_counter() - t0
        counts = corpus.table.counts()
        info = {"pages": len(pages), "html_bytes": bytes_under(folder), "tokens": counts["num_tokens"],
                "modules": len(corpus), "ingest_s": ingest_s, "budget": corpus.budget().describe(),
                "corpus_bytes_after_ingest": bytes_under(Path(tmp) / "corpus"),
                "store_bytes_after_ingest": bytes_under(Path(tmp) / "corpus" / "store")}
        print(info, flush=True)
        engine = corpus.prepare()
        rows = []
        for i, q in enumerate(questions(pages, count)):
            ans = corpus.ask(q, max_new_tokens=1)
            full = engine.generate(ans.prompt, use_cache=False, max_new_tokens=1).ttft_s
            rows.append({"i": i, "question": q, "ttft": ans.ttft_s, "full": full, "path": ans.path,
                         "served": ans.served, "hits": len(ans.hit_modules), "misses": len(ans.missed_modules),
                         "prompt_tokens": ans.prompt_tokens})
            engine.background.wait_done(timeout=think)
            if (i + 1) % 10 == 0:
                last = rows[-10:]
                print(f"{i + 1}: p50 full/ttft {statistics.median(r['full'] / r['ttft'] for r in last):.2f}, "
                      f"hits {sum(r['hits'] for r in last)}/{sum(r['hits'] + r['misses'] for r in last)}", flush=True)
        engine.background.wait_done(timeout=60)
        cov = corpus.coverage()
        bg = engine.background.stats()
        corpus.close()
        info |= {"store_bytes_after_questions": bytes_under(Path(tmp) / "corpus" / "store"),
                 "encoded_modules_after": cov.num_encoded, "encoded_tokens_after": cov.num_encoded_tokens,
                 "background": {"encoded": bg.num_encoded, "dropped": bg.num_dropped, "failed": bg.num_failed}}
        ratio = [r["full"] / r["ttft"] for r in rows]
        summary = {"first_ttft": rows[0]["ttft"], "first_full": rows[0]["full"],
                   "hundredth_ttft": rows[-1]["ttft"], "hundredth_full": rows[-1]["full"],
                   "p50_speedup": statistics.median(ratio), "p50_speedup_last_20": statistics.median(ratio[-20:]),
                   "p95_time_over_full": sorted(1 / x for x in ratio)[int(0.95 * (len(ratio) - 1))],
                   "served": {s: sum(r["served"] == s for r in rows) for s in ("store", "deferred", "waited", "none")},
                   "paths": {p: sum(r["path"] == p for r in rows) for p in ("cached", "full")}}
        out.write_text(json.dumps({"corpus": info, "summary": summary, "rows": rows}, indent=1))
        print(json.dumps(info), json.dumps(summary), sep="\n", flush=True)


if __name__ == "__main__":
    main()
