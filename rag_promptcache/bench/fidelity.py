"""Answer fidelity: does the cached prompt give the answers full prefill of the same tokens gives?

The data is bench/fidelity_data.py's confusable documents (same templates, different entities)
and long reports, built into a real corpus (real embedder, FAISS) on the loaded model, so
retrieval is real. Per k and per (encoding mode, recovery) setting, over the same questions and
prompts: full prefill's accuracy, cached accuracy, retained = cached / full, agreement of the
answer texts, and the TTFT speed-up (medians over the questions, within this run). Then one timing
point at ~`fidelity_ttft_context` tokens of context (a larger k, a few questions, TTFT only), where
the default is held to its speed-up target; `choose_default` applies the rule of issue 11.

Not here: the evaluation logic (rag/fidelity.py, shared with `rag-promptcache eval`).
"""

from __future__ import annotations

import math
import tempfile

from rag_promptcache.bench.common import Bench, median
from rag_promptcache.bench.fidelity_data import generate
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.recovery import DEFAULT_RECOVERY, Recovery
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import EvalQuestion, cached, references, summarize
from rag_promptcache.store import MemoryStore

CHUNK_TOKENS = 320  # every document is one module
TARGET_RETAINED = 0.95
TARGET_SPEEDUP, FALLBACK_SPEEDUP = 5.0, 3.0
STOP = (".",)  # the answer is its first sentence; the rest only costs decode time


def run(bench: Bench) -> dict[str, object]:
    cfg, model, tok = bench.config, bench.model, bench.tokenizer
    data = generate(cfg.fidelity_per_kind, cfg.fidelity_per_kind)
    questions = [EvalQuestion(q.question, q.answer) for q in data.questions[: cfg.fidelity_questions]]
    engines: dict[str, PromptCache] = {}
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="rpc-fidelity-") as tmp:
        modes = list(dict.fromkeys(m for m, _ in cfg.fidelity_settings))
        engines[modes[0]] = PromptCache(model, tok, store=MemoryStore(), mode=modes[0], name=bench.model_name)
        corpus = Corpus.build(data.documents, f"{tmp}/corpus", engine=engines[modes[0]], chunk_tokens=CHUNK_TOKENS,
                              progress=False)
        bench.log(f"fidelity: corpus of {len(data.documents)} documents, {corpus.last_report.num_tokens} tokens")
        for mode in modes[1:]:  # the same modules, encoded in another mode, before anything is timed
            engines[mode] = PromptCache(model, tok, store=MemoryStore(), mode=mode, name=bench.model_name)
            engines[mode].add_schema(corpus.schema)
            engines[mode].encode(corpus.manifest.name)
        corpus.prepare()
        for k in cfg.fidelity_ks:
            refs = references(corpus, questions, k, cfg.fidelity_new_tokens, STOP)
            for mode, rec in cfg.fidelity_settings:
                report = summarize(str(Recovery.parse(rec)), k, refs,
                                   cached(engines[mode], refs, rec, cfg.fidelity_new_tokens, STOP))
                rows.append({"mode": mode, **report.as_dict()})
                r = rows[-1]
                bench.log(f"fidelity k={k} {mode}/{r['recovery']}: full {r['full_correct']}/{r['with_answer']}, "
                          f"cached {r['cached_correct']}, agreement {r['agreement']:.2f}, speed-up {r['speedup']:.1f}x")
        timing = _ttft_point(bench, corpus, engines, questions)
        corpus.close()
    default = choose_default(rows, timing)
    return {"rows": rows, "ttft_at_context": timing, "chosen": default,
            "engine_default": str(Recovery.parse(DEFAULT_RECOVERY)), "questions": len(questions),
            "new_tokens": cfg.fidelity_new_tokens}


def _ttft_point(bench: Bench, corpus: Corpus, engines: dict[str, PromptCache],
                questions: list[EvalQuestion]) -> list[dict[str, object]]:
    """TTFT only, at ~fidelity_ttft_context tokens: full against each setting, interleaved per prompt."""
    cfg = bench.config
    mean_tokens = corpus.last_report.num_tokens / corpus.last_report.num_modules
    k = min(len(corpus), max(1, math.ceil(cfg.fidelity_ttft_context / mean_tokens)))
    refs = references(corpus, questions[: cfg.fidelity_ttft_questions], k, max_new_tokens=1)
    full: list[float] = []
    per: dict[tuple[str, str], list[float]] = {s: [] for s in cfg.fidelity_settings}
    engine = corpus.engine
    for mode, rec in cfg.fidelity_settings:  # warm-up each path once
        engines[mode].generate(refs[0].prompt, recovery=rec, max_new_tokens=1)
    for r in refs:
        for _ in range(cfg.repeats_slow):
            full.append(engine.generate(r.prompt, use_cache=False, max_new_tokens=1).ttft_s)
            for mode, rec in cfg.fidelity_settings:
                per[(mode, rec)].append(engines[mode].generate(r.prompt, recovery=rec, max_new_tokens=1).ttft_s)
    context = sum(r.context_tokens for r in refs) / len(refs)
    out = []
    for (mode, rec), times in per.items():
        out.append({"mode": mode, "recovery": str(Recovery.parse(rec)), "k": k, "context_tokens": context,
                    "full_ttft_s": median(full), "cached_ttft_s": median(times),
                    "speedup": median(full) / median(times)})
        bench.log(f"fidelity TTFT at {context:.0f} tokens (k={k}) {mode}/{out[-1]['recovery']}: "
                  f"{out[-1]['cached_ttft_s']:.3f} s vs full {out[-1]['full_ttft_s']:.3f} s, {out[-1]['speedup']:.1f}x")
    return out


def choose_default(rows: list[dict[str, object]], timing: list[dict[str, object]]) -> dict[str, object] | None:
    """Issue 11's rule: the fastest setting retaining >= 95% at the smallest and largest k with >= 5x
    at ~2k context; else the most faithful (worst-k retained) with >= 3x."""
    ks = sorted({r["k"] for r in rows})
    ends = {ks[0], ks[-1]}
    speed = {(t["mode"], t["recovery"]): t["speedup"] for t in timing}
    worst: dict[tuple[str, str], float] = {}
    for r in rows:
        if r["k"] in ends:
            key = (r["mode"], r["recovery"])
            value = r["retained"] if r["retained"] is not None else 0.0
            worst[key] = min(worst.get(key, math.inf), value)
    met = [s for s in worst if worst[s] >= TARGET_RETAINED and speed.get(s, 0) >= TARGET_SPEEDUP]
    if met:
        best = max(met, key=lambda s: speed[s])
        rule = f"fastest with retained >= {TARGET_RETAINED} at k={sorted(ends)} and >= {TARGET_SPEEDUP}x"
    else:
        fallback = [s for s in worst if speed.get(s, 0) >= FALLBACK_SPEEDUP]
        if not fallback:
            return None
        best = max(fallback, key=lambda s: (worst[s], speed[s]))
        rule = f"none reaches {TARGET_RETAINED}: most faithful with >= {FALLBACK_SPEEDUP}x"
    return {"mode": best[0], "recovery": best[1], "worst_retained": worst[best], "speedup": speed[best], "rule": rule}
