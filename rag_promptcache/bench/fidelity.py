"""Answer fidelity: does the cached prompt give the answers full prefill of the same tokens gives?

Three splits, each built into a real corpus (real embedder, FAISS) on the loaded model, so retrieval
is real:
- `bench`: bench/fidelity_data.py's confusable documents (same templates, different entities) and
  long reports, one module per document (`CHUNK_TOKENS`);
- `heldout`: bench/fidelity_heldout.py (issue 26 §3: other templates, facts and seed, ~250-token
  records and reports), chunked at the corpus's default chunk size;
- `manuals`: bench/fidelity_manuals.py (another shape: ~160-token how-to procedures and
  specification tables of look-alike products), chunked at the corpus's default chunk size.
Per split, k and (encoding mode, recovery) setting, over the same questions and prompts: full
prefill's accuracy (the engine's own, `use_cache=False`), cached accuracy, retained = cached / full,
kept (paired: of full prefill's right answers, the share the setting also gets right; the rule,
`fidelity.passes`, reads both),
agreement of the answer texts, the share of context tokens recomputed, and the TTFT speed-up over
the engine's full prefill (medians over the questions; per question, full prefill and every setting
run back to back, so a change of load shows in both). The engines run with
`fallback="never"`: this measures a recovery, not the planner's choice of path. Then, optionally, one
timing point at ~`fidelity_ttft_context` tokens; `choose_default` applies the rule at ~2k context,
`choose_across_splits` across splits (the rule on every split at every measured k), and
`choose_then_confirm` chosen on the bench split, then confirmed, or not, on the others.

    python -m benchmarks.fidelity --split both --k 4 8 12 \
        --settings none,last:1,last:2,last:3,question:0.05 --questions 42 --new-tokens 32 \
        --threads 2 --dtype bfloat16 --out docs/bench/fidelity-quiet-2026-11-25/tokens32

Rows say which adapter the model carried (`--adapter`). With `--reference FIDELITY_JSON` (a run of the
base model over the same questions), `retained` and `kept` are judged against that run's full-prefill
answers (bench/fidelity_reference.py) while speed-ups stay against this model's own full prefill:

    python -m benchmarks.fidelity --split all --adapter none --out base
    python -m benchmarks.fidelity --split all --adapter TUNED --reference base/fidelity.json --out tuned

Not here: the evaluation logic (rag/fidelity.py, shared with `rag-promptcache eval`).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from rag_promptcache.bench import fidelity_codecs, fidelity_data, fidelity_heldout, fidelity_manuals, fidelity_reference
from rag_promptcache.bench.common import Bench, BenchConfig, median
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
from rag_promptcache.model import links
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import (RULE, EvalQuestion, K, Outcome, Reference, answer, fastest_passing,
                                          module_prompt, passes, references, summarize)
from rag_promptcache.store import MemoryStore
from rag_promptcache.timing import describe, ratio

CHUNK_TOKENS = 320  # every document is one module
TARGET_SPEEDUP, FALLBACK_SPEEDUP = 5.0, 3.0
STOP = (".",)  # the answer is its first sentence; the rest only costs decode time
# split: (its generator, its chunk size; None: the corpus's default, as a user's)
SOURCES = {"bench": (fidelity_data, CHUNK_TOKENS), "heldout": (fidelity_heldout, None), "manuals": (fidelity_manuals, None)}
SPLITS = tuple(SOURCES)
GROUPS = {"both": ("bench", "heldout"), "all": SPLITS}  # names `--split` takes for several splits


def run(bench: Bench, splits: tuple[str, ...] | None = None, ttft_point: bool = True,
        reference: fidelity_reference.ReferenceRun | None = None) -> dict[str, object]:
    """Rows for every split (default: the config's), k and setting; with `ttft_point`, the first
    split's TTFT at ~2k context; with `reference`, answers judged against its full prefill (`check`ed
    first, before any model work)."""
    splits = bench.config.fidelity_splits if splits is None else splits
    if unknown := set(splits) - set(SPLITS):
        raise ValueError(f"unknown fidelity split(s) {sorted(unknown)}; valid: {', '.join(SPLITS)}")
    if reference is not None:
        check_reference(reference, bench.config, splits)
    trained = links.of(bench.model)
    if trained is not None and trained.num_links and not any(r.startswith("links:") for _, r in bench.config.fidelity_settings):
        # a model with trained links is measured with them too (wrapper tokens alone are in every setting)
        bench.config = dataclasses.replace(bench.config, fidelity_settings=(
            *bench.config.fidelity_settings, ("shared_prefix", f"links:{trained.num_links}")))
    rows: list[dict[str, object]] = []
    codec_rows: list[dict[str, object]] = []
    timing: list[dict[str, object]] = []
    questions = 0
    for i, split in enumerate(splits):
        out = _run_split(bench, split, ttft_point and i == 0, reference)
        rows += out["rows"]
        codec_rows += out["codec_rows"]
        timing += out["timing"]
        questions = max(questions, out["questions"])
    cfg = bench.config
    judged = {} if reference is None else {
        "reference": {"path": reference.path, "adapter": reference.adapter},
        "full_prefill_against_reference": fidelity_reference.full_prefill_against(rows)}
    return {**judged, "adapter": fidelity_reference.adapter_label(bench.model), "rows": rows, "codec_rows": codec_rows,
            "ttft_at_context": timing,
            "chosen": choose_default(rows, timing) if timing else None,
            "across_splits": choose_across_splits(rows), "chosen_then_confirmed": choose_then_confirm(rows),
            "splits": list(splits),
            "engine_default": str(Recovery.parse(DEFAULT_RECOVERY)), "questions": questions,
            "retrieval": cfg.fidelity_retrieval, "neighbours": cfg.fidelity_neighbours,
            "neighbours_present": cfg.fidelity_neighbours_present, "new_tokens": cfg.fidelity_new_tokens}


def check_reference(reference: fidelity_reference.ReferenceRun, cfg: BenchConfig, splits: tuple[str, ...]) -> None:
    """Refuse a reference that did not ask the questions this configuration asks (ValueError)."""
    questions = {s: [(q.question, (q.answer,)) for q in split_data(s, cfg.fidelity_per_kind, cfg.fidelity_seed_offset)[0]
                     .questions[: cfg.fidelity_questions]] for s in splits}
    fidelity_reference.check(reference, questions, cfg.fidelity_ks)


def _run_split(bench: Bench, split: str, ttft_point: bool,
               reference: fidelity_reference.ReferenceRun | None = None) -> dict[str, object]:
    cfg, model, tok = bench.config, bench.model, bench.tokenizer
    adapter = fidelity_reference.adapter_label(model)
    data, chunk = split_data(split, cfg.fidelity_per_kind, cfg.fidelity_seed_offset)
    questions = [EvalQuestion(q.question, (q.answer,)) for q in data.questions[: cfg.fidelity_questions]]
    engines: dict[str, PromptCache] = {}
    rows: list[dict[str, object]] = []
    timing: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="rpc-fidelity-") as tmp:
        # no settings: the codec rows alone, over modules encoded in the default mode
        modes = list(dict.fromkeys(m for m, _ in cfg.fidelity_settings)) or ["shared_prefix"]
        engines[modes[0]] = PromptCache(model, tok, store=MemoryStore(codec=cfg.fidelity_codec), mode=modes[0], name=bench.model_name,
                                        **NO_FALLBACK)
        corpus = Corpus.build(data.documents, f"{tmp}/corpus", engine=engines[modes[0]], chunk_tokens=chunk,
                              progress=False, neighbours=cfg.fidelity_neighbours,
                              neighbours_present=cfg.fidelity_neighbours_present)
        bench.log(f"fidelity {split}: corpus of {len(data.documents)} documents, {len(corpus)} modules, "
                  f"{corpus.last_report.num_tokens} tokens")
        if cfg.fidelity_neighbours_present:  # what idle time writes after ingest (`warm --all`), before anything is timed
            corpus.warm(None)
        for mode in modes[1:]:  # the same modules, encoded in another mode, before anything is timed
            engines[mode] = PromptCache(model, tok, store=MemoryStore(codec=cfg.fidelity_codec), mode=mode, name=bench.model_name,
                                        **NO_FALLBACK)
            engines[mode].add_schema(corpus.schema)
            engines[mode].encode(corpus.manifest.name)
        corpus.prepare()
        for k in cfg.fidelity_ks if reference is not None and cfg.fidelity_settings else ():  # before any answer is computed
            digests = [module_prompt(corpus, q.question, k, cfg.fidelity_retrieval).digest for q in questions]
            if warning := fidelity_reference.check_prompts(reference, split, k, digests):
                bench.log(f"warning: {warning}")
        if cfg.fidelity_settings:
            _warm_up(engines, cfg.fidelity_settings,
                     references(corpus, questions[:1], cfg.fidelity_ks[0], 1, retrieval=cfg.fidelity_retrieval)[0].prompt)
        for k in cfg.fidelity_ks if cfg.fidelity_settings else ():
            refs, outcomes = _answer_interleaved(corpus, engines, cfg.fidelity_settings, questions, k,
                                                 cfg.fidelity_new_tokens, cfg.fidelity_retrieval)
            for mode, rec in cfg.fidelity_settings:
                report = summarize(str(Recovery.parse(rec)), k, refs, outcomes[(mode, rec)])
                share = recomputed_share(engines[mode], refs, rec)
                r = fidelity_reference.row(split, adapter, mode, cfg.fidelity_codec, report, reference,
                                           recomputed_share=share)
                rows.append(r)
                against = "" if reference is None else f" (reference full {r['reference_full_correct']})"
                bench.log(f"fidelity {split} k={k} {mode}/{r['recovery']}: full {r['full_correct']}/{r['with_answer']}{against}, "
                          f"cached {r['cached_correct']}, agreement {r['agreement']:.2f}, recomputed {share:.3f}, "
                          f"speed-up {describe(r['speedup'], '.1f', 'x')} over the engine's full prefill")
        codec_rows = fidelity_codecs.rows(bench, split, corpus, engines[modes[0]], questions) if cfg.fidelity_codecs else []
        if ttft_point and cfg.fidelity_settings:
            timing = _ttft_point(bench, corpus, engines, questions)
        corpus.close()
    return {"rows": rows, "codec_rows": codec_rows, "timing": timing, "questions": len(questions)}


def split_data(split: str, per_kind: int = fidelity_data.PER_KIND, seed_offset: int = 0) -> tuple[fidelity_data.Dataset, int | None]:
    """A split's documents and questions, its generator seeded `seed_offset` above its own seed, and the
    chunk size its corpus is built with."""
    source, chunk = SOURCES[split]
    return source.generate(per_kind, per_kind, seed=source.SEED + seed_offset), chunk


# A recovery is measured, not the planner's choice of path, and every prompt is computed as it
# would be the first time: no prefix of an earlier request (another setting's, the warm-up's) reused.
NO_FALLBACK = {"fallback": "never", "prefix_cache_bytes": 0}


def _warm_up(engines: dict[str, PromptCache], settings: tuple[tuple[str, str], ...], prompt: str) -> None:
    """Every setting's path once on `prompt` before anything is timed, so no first timing is a cold one
    (the caller's `references` has run full prefill's)."""
    for mode, rec in settings:
        engines[mode].generate(prompt, recovery=rec, max_new_tokens=1)


def _answer_interleaved(corpus: Corpus, engines: dict[str, PromptCache], settings: tuple[tuple[str, str], ...],
                        questions: list[EvalQuestion], k: int, new_tokens: int, retrieval: str = "dense",
                        ) -> tuple[list[Reference], dict[tuple[str, str], list[Outcome]]]:
    """Per question, full prefill's answer and then each setting's, back to back: the TTFTs a speed-up
    divides are taken seconds apart, under the same load, not minutes apart."""
    refs: list[Reference] = []
    outcomes: dict[tuple[str, str], list[Outcome]] = {s: [] for s in settings}
    for q in questions:
        refs.append(references(corpus, [q], k, new_tokens, STOP, retrieval)[0])
        for mode, rec in settings:
            outcomes[(mode, rec)].append(answer(engines[mode], refs[-1], rec, new_tokens, STOP))
    return refs, outcomes


def recomputed_share(engine: PromptCache, refs: list[Reference], recovery: str) -> float:
    """The share of the retrieved modules' tokens that `recovery` computes again, over all the prompts:
    the plan's computed tokens beyond `none`'s (the question and glue), over the context tokens."""
    extra = 0
    for r in refs:
        fresh = [sum(len(p.token_ids) for p in engine.plan(r.prompt, recovery=rec).pieces if not p.cached)
                 for rec in (recovery, "none")]
        extra += fresh[0] - fresh[1]
    return extra / max(1, sum(r.context_tokens for r in refs))


def _ttft_point(bench: Bench, corpus: Corpus, engines: dict[str, PromptCache],
                questions: list[EvalQuestion]) -> list[dict[str, object]]:
    """TTFT only, at ~fidelity_ttft_context tokens: full against each setting, interleaved per prompt."""
    cfg = bench.config
    mean_tokens = corpus.last_report.num_tokens / corpus.last_report.num_modules
    k = min(len(corpus), max(1, math.ceil(cfg.fidelity_ttft_context / mean_tokens)))
    refs = references(corpus, questions[: cfg.fidelity_ttft_questions], k, 1, retrieval=cfg.fidelity_retrieval)
    full: list[float] = []
    per: dict[tuple[str, str], list[float]] = {s: [] for s in cfg.fidelity_settings}
    engine = corpus.engine
    _warm_up(engines, cfg.fidelity_settings, refs[0].prompt)
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
                    "speedup": ratio(median(full), median(times))})
        bench.log(f"fidelity TTFT at {context:.0f} tokens (k={k}) {mode}/{out[-1]['recovery']}: "
                  f"{out[-1]['cached_ttft_s']:.3f} s vs full {out[-1]['full_ttft_s']:.3f} s, "
                  f"{describe(out[-1]['speedup'], '.1f', 'x')}")
    return out


def row_score(row: dict[str, object]) -> tuple[float, float]:
    """What the rule (`fidelity.passes`) reads of one row: retained and kept (paired, `SettingReport.kept`);
    0 where not measurable (a row without per-question answers, or full prefill got nothing right)."""
    return row.get("retained") or 0.0, row.get("kept") or 0.0


def row_setting(row: dict[str, object]) -> tuple[str, str, str]:
    """What a rule compares: the adapter the model carried (rows from before adapters: the base), the
    encoding mode and the recovery."""
    return row.get("adapter", fidelity_reference.BASE), row["mode"], row["recovery"]


def worst_scores(rows: Iterable[dict[str, object]], key: Callable[[dict[str, object]], K]) -> dict[K, tuple[float, float]]:
    """Per setting (`key`), its worst retained and worst kept over `rows`: it passes where every row does."""
    worst: dict[K, tuple[float, float]] = {}
    for r in rows:
        retained, kept = row_score(r)
        was = worst.get(key(r), (math.inf, math.inf))
        worst[key(r)] = (min(was[0], retained), min(was[1], kept))
    return worst


def choose_across_splits(rows: list[dict[str, object]]) -> dict[str, object] | None:
    """The fastest setting (its slowest speed-up at the largest k, over the splits) that passes the rule
    (`fidelity.passes`) on every split at every measured k; None when none does."""
    largest = max((r["k"] for r in rows), default=0)
    worst = worst_scores(rows, row_setting)
    speed: dict[tuple[str, str, str], float] = {}
    for r in rows:
        if r["k"] == largest:
            key = row_setting(r)
            speed[key] = min(speed.get(key, math.inf), r["speedup"] or 0.0)  # None: not measured, no evidence of speed
    best = fastest_passing(worst, {s: speed.get(s, 0.0) for s in worst})
    if best is None:
        return None
    return {"adapter": best[0], "mode": best[1], "recovery": best[2], "worst_retained": worst[best][0],
            "worst_kept": worst[best][1], "speedup_at_largest_k": speed.get(best),
            "rule": f"fastest with {RULE} on every split at every k (speed-up at k={largest})"}


def choose_then_confirm(rows: list[dict[str, object]], on: str = "bench") -> dict[str, object] | None:
    """Choose on one split, confirm on the others: the fastest setting (speed-up at the largest k) passing
    the rule at every measured k of split `on`; then, per other split, its worst retained and kept there
    and whether they pass too. None when nothing qualifies on `on`."""
    picked = choose_across_splits([r for r in rows if r.get("split", "bench") == on])
    if picked is None:
        return None
    mine = [r for r in rows if row_setting(r) == (picked["adapter"], picked["mode"], picked["recovery"])]
    elsewhere = worst_scores((r for r in mine if r.get("split", "bench") != on), lambda r: r.get("split", "bench"))
    return {**picked, "chosen_on": on, "worst_kept_elsewhere": {s: kept for s, (_, kept) in elsewhere.items()},
            "worst_retained_elsewhere": {s: retained for s, (retained, _) in elsewhere.items()},
            "confirmed": all(passes(*score) for score in elsewhere.values())}


def choose_default(rows: list[dict[str, object]], timing: list[dict[str, object]]) -> dict[str, object] | None:
    """The fastest setting passing the rule at the smallest and largest k with >= 5x at ~2k context; else
    the most faithful (worst-k kept) with >= 3x."""
    ks = sorted({r["k"] for r in rows})
    ends = {ks[0], ks[-1]}
    speed = {(t["mode"], t["recovery"]): t["speedup"] for t in timing}
    worst = worst_scores((r for r in rows if r["k"] in ends), lambda r: (r["mode"], r["recovery"]))
    best = fastest_passing(worst, speed, min_speedup=TARGET_SPEEDUP)
    if best is not None:
        rule = f"fastest with {RULE} at k={sorted(ends)} and >= {TARGET_SPEEDUP}x"
    else:
        fallback = [s for s in worst if (speed.get(s) or 0.0) >= FALLBACK_SPEEDUP]
        if not fallback:
            return None
        best = max(fallback, key=lambda s: (worst[s][1], speed[s]))
        rule = f"none passes {RULE}: most faithful with >= {FALLBACK_SPEEDUP}x"
    return {"mode": best[0], "recovery": best[1], "worst_retained": worst[best][0], "worst_kept": worst[best][1],
            "speedup": speed[best], "rule": rule}

