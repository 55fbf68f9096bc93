"""How alike are the modules a question retrieves, per split and draw, and does it tell where modules
read after their neighbours (`--neighbours 3`, `none`) keep the answers? Joins each prompt's similarity with
the by-product run's per-question answers (docs/bench/byproduct-2026-12-02: same splits, draws, k, dense
retrieval, 42 questions), no model forward: `PYTHONPATH=. python docs/bench/pick-2026-12-03/similarity.py`
writes similarity.json here (skipped when it is there) and prints, pooled over both draws, each setting's kept
answers by the prompt's `near`, and what a per-prompt gate would keep: modules read after their neighbours
with nothing recomputed (`nbr:3+none`) where every module's `near` is below a threshold, plain `last:1`
otherwise (simulated from the two rows' answers to the same prompts).

Per prompt: `pair`, the mean cosine between the retrieved modules' embeddings (the corpus's own MiniLM
vectors, normalized); `near`, the mean over its modules of the cosine to their nearest other module in the corpus (`near_max`: the largest).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from rag_promptcache.bench import fidelity as bench_fidelity
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import module_prompt

RUNS = Path("docs/bench/byproduct-2026-12-02")
DRAWS = {0: {"bench": ["bench", "bench-k8-12"], "heldout": ["heldout-manuals"], "manuals": ["heldout-manuals"]},
         1: {s: ["draw1"] for s in ("bench", "heldout", "manuals")}}


def answers(draw: int, split: str) -> dict[tuple[int, str], dict[str, dict]]:
    """(k, question) -> setting -> its answer row (cached_right, reference_right)."""
    out: dict[tuple[int, str], dict[str, dict]] = {}
    for folder in DRAWS[draw][split]:
        for row in json.loads((RUNS / folder / "fidelity.json").read_text())["rows"]:
            if row["split"] != split:
                continue
            setting = row["recovery"] if "recovery" in row else row["setting"]
            for a in row["answers"]:
                out.setdefault((row["k"], a["question"]), {})[setting] = a
    return out


def measure(path: Path) -> None:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.model.loading import load_model
    from rag_promptcache.store import MemoryStore

    model, tok = load_model("smollm2-135m-instruct", dtype="bfloat16", adapter="default")
    engine = PromptCache(model, tok, store=MemoryStore(), name="smollm2-135m-instruct", **bench_fidelity.NO_FALLBACK)
    rows = []
    for draw in (0, 1):
        for split in bench_fidelity.SPLITS:
            data, chunk = bench_fidelity.split_data(split, 6, draw)
            got = answers(draw, split)
            with tempfile.TemporaryDirectory() as tmp:
                corpus = Corpus.build(data.documents, f"{tmp}/c", engine=engine, chunk_tokens=chunk, progress=False, kv="lazy")
                fids, vecs = corpus.table.vectors(corpus.manifest.dim)
                vecs = vecs / np.linalg.norm(vecs, axis=1, keepdims=True)
                names = corpus.table.module_ids_for(list(map(int, fids)))
                row_of = {names[int(f)]: i for i, f in enumerate(fids)}
                sims = vecs @ vecs.T
                np.fill_diagonal(sims, -1)
                nearest = sims.max(axis=1)
                for k in (4, 8, 12):
                    for q in data.questions[:42]:
                        ids = module_prompt(corpus, q.question, k, "dense").module_ids
                        idx = [row_of[m] for m in ids]
                        sub = sims[np.ix_(idx, idx)]
                        pair = float(sub[~np.eye(len(idx), dtype=bool)].mean())
                        res = got.get((k, q.question), {})
                        rows.append({"draw": draw, "split": split, "k": k, "question": q.question, "pair": pair,
                                     "near": float(nearest[idx].mean()), "near_max": float(nearest[idx].max()),
                                     **{s: (a.get("reference_right"), a.get("cached_right")) for s, a in res.items()}})
                corpus.close()
            print(draw, split, len(rows), flush=True)
    path.write_text(json.dumps(rows, indent=1))


def kept(rows: list[dict], pick) -> tuple[int, int]:
    """(kept, the reference's right answers) of the setting `pick(row)` names, over `rows`."""
    judged = [r for r in rows if r.get("none") and r["none"][0]]
    return sum(bool(r[pick(r)][1]) for r in judged), len(judged)


def summarize(rows: list[dict]) -> None:
    settings = ("none", "last:1", "nbr:3+none", "byp+none")
    print("| split | near | prompts | " + " | ".join(settings) + " |")
    print("|---|---|---|" + "---|" * len(settings))
    for split in bench_fidelity.SPLITS:
        for lo, hi in ((0, 0.7), (0.7, 0.75), (0.75, 0.8), (0.8, 0.85), (0.85, 0.9), (0.9, 1.01)):
            rs = [r for r in rows if r["split"] == split and lo <= r["near"] < hi]
            if rs:
                cells = ["%d / %d" % kept(rs, lambda r, s=s: s) for s in settings]
                print(f"| {split} | {lo:.2f}-{min(hi, 1):.2f} | {len(rs)} | " + " | ".join(cells) + " |")
    print()
    print("| gate: `nbr:3+none` where every module's near < t | " + " | ".join(
        f"{s} k={k}" for s in bench_fidelity.SPLITS for k in (4, 8, 12)) + " |")
    print("|---|" + "---|" * 9)
    for t in (0.75, 0.8, 0.85, 0.9):
        cells = []
        for split in bench_fidelity.SPLITS:
            for k in (4, 8, 12):
                rs = [r for r in rows if r["split"] == split and r["k"] == k]
                got, base = kept(rs, lambda r: "nbr:3+none" if r["near_max"] < t else "last:1")
                cells.append(f"{got / base:.2f} ({sum(r['near_max'] < t for r in rs) / len(rs):.2f})")
        print(f"| t = {t} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    out = Path(__file__).parent / "similarity.json"
    if not out.exists():
        measure(out)
    summarize(json.loads(out.read_text()))
