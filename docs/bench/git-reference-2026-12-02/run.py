"""A real reference of about a million tokens ingested lazily, as a user would: Git's HTML manual
(Debian's git-doc, every `.html` file under /usr/share/doc/git-doc; `make manuals` installs it), the
corpus's defaults (k = 4, its default budget, misses computed in the request and stored by the background
encoder while no request runs, the default fallback). Measured: the ingest's time, the store's size after
it and after the questions, and each question's TTFT against the engine's own full prefill of the same
prompt (run right after it). The questions are a user's: "What does git NAME do?" for the manual's
pages in a shuffled order, then a fifth of them asked again; between questions the background encoder
gets up to `think` seconds (a user reading the answer).

The first question is also timed as a user meets it, each in a fresh process on the freshly ingested
corpus (store empty): `ask` against the engine's full prefill of the same prompt, alternated `FIRST_TRIALS`
times (both pay the process's first forward; in the question loop the full prefill runs second and
would not).

Run from the repository root:
python docs/bench/git-reference-2026-12-02/run.py OUT.json WORKDIR [questions] [think]
(WORKDIR keeps the corpus; an existing one is reused, its store emptied.)
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rag_promptcache.rag.corpus import Corpus

MANUAL = Path("/usr/share/doc/git-doc")
REPEAT = 0.2  # the share of questions asked again later (a user's second look)
FIRST_TRIALS = 3
COLD = {"ask": """
import sys
from rag_promptcache.rag.corpus import Corpus
c = Corpus.open(sys.argv[1], redis_url="")
print(c.ask(sys.argv[2], max_new_tokens=1).ttft_s)
c.close()
""", "full": """
import sys
from rag_promptcache.rag.corpus import Corpus
c = Corpus.open(sys.argv[1], redis_url="")
prompt = c.prompt(sys.argv[2], c.order([h.module_id for h in c.retrieve(sys.argv[2])]))
print(c.prepare().generate(prompt, use_cache=False, max_new_tokens=1).ttft_s)
c.close()
"""}


def bytes_under(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def questions(pages: list[Path], count: int) -> list[str]:
    names = sorted(p.stem.removeprefix("git-") for p in pages if p.stem.startswith("git-"))
    rng = random.Random(11)
    rng.shuffle(names)
    fresh = [f"What does git {n} do?" for n in names[:int(count * (1 - REPEAT))]]
    again = rng.sample(fresh, count - len(fresh))
    return (fresh + again)[:count]  # the repeats last


def cold_first(path: Path, question: str) -> dict[str, list[float]]:
    """The first question's TTFT in fresh processes on an empty store: `ask`, then full prefill, alternated."""
    out: dict[str, list[float]] = {"ask": [], "full": []}
    for _ in range(FIRST_TRIALS):
        for kind, code in COLD.items():
            shutil.rmtree(path / "store", ignore_errors=True)
            run = subprocess.run([sys.executable, "-c", code, str(path), question], capture_output=True, text=True,
                                 check=True)
            out[kind].append(float(run.stdout.split()[-1]))
    shutil.rmtree(path / "store", ignore_errors=True)
    return out


def main() -> None:
    out = Path(sys.argv[1])
    work = Path(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    think = float(sys.argv[4]) if len(sys.argv) > 4 else 2.0
    pages = sorted(MANUAL.glob("*.html"))
    path = work / "corpus"
    info: dict[str, object] = {"pages": len(pages)}
    if not (path / "manifest.json").exists():
        folder = work / "git-doc"
        folder.mkdir(parents=True, exist_ok=True)
        for p in pages:
            shutil.copy(p, folder / p.name)
        t0 = time.perf_counter()
        Corpus.build([folder], path, kv="lazy", progress=False, redis_url="").close()
        info |= {"ingest_s": time.perf_counter() - t0, "html_bytes": bytes_under(folder),
                 "corpus_bytes_after_ingest": bytes_under(path),
                 "store_bytes_after_ingest": bytes_under(path / "store") if (path / "store").exists() else 0}
        print(info, flush=True)
    asked = questions(pages, count)
    info["first_cold"] = cold_first(path, asked[0])
    corpus = Corpus.open(path, redis_url="")
    info |= {"tokens": corpus.table.counts()["num_tokens"], "modules": len(corpus),
             "budget": corpus.budget.describe()}
    print(info, flush=True)
    engine = corpus.prepare()
    rows = []
    for i, q in enumerate(asked):
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
    info |= {"store_bytes_after_questions": bytes_under(path / "store"),
             "encoded_modules_after": cov.num_encoded, "encoded_tokens_after": cov.num_encoded_tokens,
             "background": {"encoded": bg.num_encoded, "dropped": bg.num_dropped, "failed": bg.num_failed}}
    ratio = [r["full"] / r["ttft"] for r in rows]
    first = info["first_cold"]
    summary = {"first_cold_ask_median": statistics.median(first["ask"]),
               "first_cold_full_median": statistics.median(first["full"]),
               "first_ttft": rows[0]["ttft"], "first_full": rows[0]["full"],
               "hundredth_ttft": rows[-1]["ttft"], "hundredth_full": rows[-1]["full"],
               "p50_speedup": statistics.median(ratio), "p50_speedup_last_20": statistics.median(ratio[-20:]),
               "p95_time_over_full": sorted(1 / x for x in ratio)[int(0.95 * (len(ratio) - 1))],
               "served": {s: sum(r["served"] == s for r in rows) for s in ("store", "deferred", "waited", "none")},
               "paths": {p: sum(r["path"] == p for r in rows) for p in ("cached", "full")}}
    out.write_text(json.dumps({"corpus": info, "summary": summary, "rows": rows}, indent=1))
    print(json.dumps(info), json.dumps(summary), sep="\n", flush=True)


if __name__ == "__main__":
    main()
