"""Which few cached tokens must be recomputed? Question-aware selection against whole-module recovery (issue 26).

    python -m research.selection_probe --split bench --questions 24 --k 4 8 12 \
        --settings "none;last:1;last:2;sel:0.1;sel:0.1,sinks=2" --json out/sel-bench.json

Per question and k: the corpus prompt (best-ranked module next to the question), full prefill's answer
(the engine's own, `use_cache=False`) and each setting's answer from the cache, greedy, cut at the
first ".". Engine settings (`none`, `last:N`, ...) run through `generate`; `sel:R[,key=value...]`
(engine/planning/select.py: ratio R of the stale module tokens, keys layers=4+8+12, shape=tokens|sentences,
window, sinks, near) plans with `none`, scores and splits, then runs the same prefill and decode: its
TTFT counts the plan, the scoring pass and the recomputation. Reported per k and setting: right
answers, retained (cached right / full right), the share of context tokens recomputed, and the median
TTFT ratio to full prefill. `--split heldout` uses bench/fidelity_heldout.py (~250-token records).

Not here: choosing the default (bench/fidelity.py) or changing the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rag_promptcache.bench.fidelity import CHUNK_TOKENS, SPLITS, STOP, split_data
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.decoding.sampling import Sampling
from rag_promptcache.engine.planning.recovery import split
from rag_promptcache.engine.result import Stream
from rag_promptcache.engine.planning.select import Selection, choose, question_mass, stale_tokens
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import answer_contains
from rag_promptcache.store import DiskStore


def parse_selection(spec: str) -> Selection:
    """"sel:0.1,layers=4+8,shape=sentences,window=1,sinks=2,near=2"."""
    ratio, *opts = spec.removeprefix("sel:").split(",")
    kw: dict[str, object] = {}
    for o in opts:
        key, _, value = o.partition("=")
        if key == "layers":
            kw[key] = tuple(int(x) for x in value.split("+"))
        elif key == "shape":
            kw[key] = value
        elif key in ("window", "sinks", "near", "whole"):
            kw[key] = int(value)
        else:
            raise ValueError(f"unknown selection option {key!r}; valid: layers, shape, window, sinks, near, whole")
    return Selection(float(ratio), **kw)  # type: ignore[arg-type]


def sentence_ends(tokenizer) -> frozenset[int]:
    return frozenset(i for i in range(len(tokenizer)) if tokenizer.decode([i]).rstrip().endswith((".", "!", "?")))


def run_one(engine: PromptCache, prompt: str, setting: str, ends: frozenset[int], max_new: int) -> tuple[str, float, int]:
    """(answer, TTFT s, cached module tokens recomputed)."""
    base = engine.plan(prompt, recovery="none", max_new_tokens=max_new)
    fresh0 = sum(len(p.token_ids) for p in base.pieces if not p.cached)
    if not setting.startswith("sel:"):
        res = engine.generate(prompt, recovery=setting, max_new_tokens=max_new, stop=STOP)
        plan = engine.plan(prompt, recovery=setting, max_new_tokens=max_new)
        return res.text, res.ttft_s, sum(len(p.token_ids) for p in plan.pieces if not p.cached) - fresh0
    sel = parse_selection(setting)
    t0 = time.perf_counter()
    plan = engine.plan(prompt, recovery="none", max_new_tokens=max_new)
    with engine.model_lock:
        mass = question_mass(plan.pieces, plan.kvs, engine.model, engine.relocator, engine.geometry, sel.layers)
        chosen = choose(stale_tokens(plan.pieces, plan.kvs), mass, sel, ends)
    plan = dataclasses.replace(plan, pieces=tuple(split(plan.pieces, chosen)))
    res = Stream(engine._run(plan, Sampling(max_new_tokens=max_new, stop=STOP), t0)).consume()
    return res.text, res.ttft_s, len(chosen)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--split", choices=SPLITS, default="bench")
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 12])
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--settings", default="none;last:1;last:2;sel:0.1")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path, help="keep the corpus and its KV here between runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    settings = [s.strip() for s in args.settings.split(";") if s.strip()]
    for s in settings:
        if s.startswith("sel:"):
            parse_selection(s)
    data = split_data(args.split)[0]
    qs = data.questions[: args.questions]
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        where = (args.workdir or Path(tmp)) / args.split
        engine = PromptCache.from_pretrained("smollm2-135m-instruct", dtype=args.dtype, store=DiskStore(where / "kv"))
        if (where / "c").exists():
            corpus = Corpus.open(where / "c", engine=engine)
        else:
            corpus = Corpus.build(data.documents, where / "c", engine=engine, chunk_tokens=CHUNK_TOKENS, progress=False)
        corpus.prepare()
        ends = sentence_ends(engine.tokenizer)
        for k in args.k:
            per: dict[str, dict[str, list]] = {s: {"right": [], "ttft": [], "fresh": []} for s in settings}
            full_right, full_ttft, context = [], [], []
            for q in qs:
                ids = [m for m, _ in corpus.search(q.question, k)]
                prompt = corpus.prompt(q.question, corpus.order(ids))
                engine.generate(prompt, recovery="none", max_new_tokens=1)  # the KV in memory before timing
                full = engine.generate(prompt, use_cache=False, max_new_tokens=args.new_tokens, stop=STOP)
                full_right.append(answer_contains(full.text, q.answer))
                full_ttft.append(full.ttft_s)
                context.append(sum(corpus.table.module(m)[1] for m in ids))
                line = []
                for s in settings:
                    text, ttft, fresh = run_one(engine, prompt, s, ends, args.new_tokens)
                    per[s]["right"].append(answer_contains(text, q.answer))
                    per[s]["ttft"].append(ttft)
                    per[s]["fresh"].append(fresh)
                    line.append(f"{s}={int(per[s]['right'][-1])}")
                print(f"k={k} full={int(full_right[-1])} {' '.join(line)} | {q.question}", flush=True)
            for s in settings:
                right = sum(per[s]["right"])
                rows.append({
                    "split": args.split, "k": k, "setting": s, "questions": len(qs), "full_right": sum(full_right),
                    "cached_right": right, "retained": right / max(1, sum(full_right)),
                    "both_right": sum(a and b for a, b in zip(full_right, per[s]["right"])),
                    "recomputed_share": sum(per[s]["fresh"]) / sum(context),
                    "context_tokens": statistics.mean(context),
                    "ttft_ratio": statistics.median(f / c for f, c in zip(full_ttft, per[s]["ttft"])),
                    "full_ttft_s": statistics.median(full_ttft), "cached_ttft_s": statistics.median(per[s]["ttft"]),
                })
                r = rows[-1]
                print(f"== {args.split} k={k} {s:<40} full {r['full_right']}/{len(qs)} cached {right} "
                      f"retained {r['retained']:.2f} recomputed {r['recomputed_share']:.3f} "
                      f"ttft x{r['ttft_ratio']:.1f} (ctx {r['context_tokens']:.0f})", flush=True)
        corpus.close()
    out = {"split": args.split, "questions": len(qs), "new_tokens": args.new_tokens, "dtype": args.dtype,
           "threads": 1, "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
