"""The fidelity sweeps' runner: the fidelity scenario (rag_promptcache/bench/fidelity.py, `rag-promptcache bench
--scenarios fidelity`) alone, with its splits, k, settings, seeds and sizes on the command line; a tuned
adapter judged against the base model's run (`--reference`), or a run judged anew against a reference made
since (`--rejudge`); several runs (other seeds) pooled into one report (`--pool`). What docs/FIDELITY.md's tables were made with:

    python -m benchmarks.fidelity --split both --k 4 8 12 \
        --settings none,last:1,last:2,last:3,question:0.05 --questions 42 --new-tokens 32 \
        --threads 2 --dtype bfloat16 --out docs/bench/fidelity-quiet-2026-11-25/tokens32
    python -m benchmarks.fidelity --split all --adapter none --out base
    python -m benchmarks.fidelity --split all --adapter TUNED --reference base/fidelity.json --out tuned
    python -m benchmarks.fidelity --pool base/fidelity.json base-seed1/fidelity.json --out pooled
    python -m benchmarks.fidelity --rejudge tuned/fidelity.json --reference new-base/fidelity.json --out rejudged

Writes fidelity.json, fidelity.md and the front PNG into `--out`. Not here: the scenario itself, its
splits and rules (rag_promptcache/bench/fidelity.py), the evaluation logic (rag/fidelity.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from rag_promptcache.bench import fidelity, fidelity_reference, report
from rag_promptcache.bench.common import Bench, BenchConfig
from rag_promptcache.bench.fidelity import row_setting
from rag_promptcache.engine.planning.recovery import Recovery
from rag_promptcache.timing import ratio


def pool(runs: list[dict[str, object]]) -> dict[str, object]:
    """Several runs of this scenario (other seeds: `--seed-offset`) as one: per split, k and setting,
    right answers summed, so retained and kept rest on every question asked; times, shares and
    agreement averaged over the runs. The rules are applied to the pooled rows. Rows judged against a
    reference (`--reference`) pool against the references' right answers; each adapter's rows stay apart."""
    groups: dict[tuple, list[dict[str, object]]] = {}
    for run_ in runs:
        for r in run_["rows"]:
            groups.setdefault((r.get("split", "bench"), r["k"], *row_setting(r)), []).append(r)
    rows = []
    for (split, k, adapter, mode, rec), rs in groups.items():
        judged = sum("reference_full_correct" in r for r in rs)
        if judged not in (0, len(rs)):
            raise ValueError(f"cannot pool {split} k={k} {adapter}:{mode}/{rec}: {judged} of its {len(rs)} runs were "
                             "judged against a reference (--reference) and the others against their own full prefill")
        mean = lambda key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
        paired = lambda key, of: sum(  # noqa: E731
            bool(a[key] and a["cached_right"]) for r in rs for a in r.get("answers", ())) / of if of and all(
            "answers" in r for r in rs) else None
        full, right = sum(r["full_correct"] for r in rs), sum(r["cached_correct"] for r in rs)
        ref = sum(r["reference_full_correct"] for r in rs) if judged else full
        full_s, cached_s = mean("full_ttft_s"), mean("cached_ttft_s")
        rows.append({"split": split, "k": k, "adapter": adapter, "mode": mode, "recovery": rec, "runs": len(rs),
                     "questions": sum(r["questions"] for r in rs), "with_answer": sum(r["with_answer"] for r in rs),
                     "full_correct": full, "cached_correct": right, "retained": right / ref if ref else None,
                     "kept": paired("reference_right" if judged else "full_right", ref),
                     "agreement": mean("agreement"), "recomputed_share": mean("recomputed_share"),
                     "context_tokens": mean("context_tokens"), "full_ttft_s": full_s, "cached_ttft_s": cached_s,
                     "speedup": ratio(full_s, cached_s)})
        if judged:
            rows[-1].update({"reference_full_correct": ref, "own_retained": right / full if full else None,
                             "own_kept": paired("full_right", full)})
    against = fidelity_reference.full_prefill_against(rows)
    return {**({"full_prefill_against_reference": against} if against else {}), "rows": rows, "ttft_at_context": [], "chosen": None, "across_splits": fidelity.choose_across_splits(rows),
            "chosen_then_confirmed": fidelity.choose_then_confirm(rows), "splits": list(dict.fromkeys(r["split"] for r in rows)),
            "runs": len(runs), "seed_offsets": [run_.get("seed_offset", 0) for run_ in runs]}


def main(argv: list[str] | None = None) -> dict[str, object]:
    """The fidelity scenario alone, with its split and sizes on the command line (module docstring)."""
    ap = argparse.ArgumentParser(description="Answer fidelity of recovery settings against the engine's full prefill.")
    ap.add_argument("--split", choices=(*fidelity.SPLITS, *fidelity.GROUPS), default="both",
                    help="one split, both (bench and heldout) or all")
    ap.add_argument("--k", type=int, nargs="+", default=list(BenchConfig().fidelity_ks))
    ap.add_argument("--settings", default="none,last:1,last:2,last:3,question:0.05",
                    help="comma-separated RECOVERY or MODE/RECOVERY ('' for none: the codec rows alone)")
    ap.add_argument("--questions", type=int, default=BenchConfig().fidelity_questions, help="per split (42: all)")
    ap.add_argument("--per-kind", type=int, default=BenchConfig().fidelity_per_kind,
                    help="documents per kind of each split (6: all; fewer make a smaller corpus)")
    ap.add_argument("--new-tokens", type=int, default=BenchConfig().fidelity_new_tokens)
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="added to each split's seed: other entities and facts in the same templates")
    ap.add_argument("--codec", default="native", help="store codec of the cached modules (store/codecs.py)")
    ap.add_argument("--codecs", default=",".join(BenchConfig().fidelity_codecs),
                    help="comma-separated codecs whose answers are compared with fp16 modules' per split and k "
                         "('' for none)")
    ap.add_argument("--codec-recovery", default=None,
                    help="the recovery of the codec rows [default: the engine's, the adapter's where one is merged]")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--adapter", default="default", metavar="PATH|default|none",
                    help="the tuned adapter merged into the model: default (the one shipped for the model, if one "
                         "ships), none (the base model) or an adapter directory")
    ap.add_argument("--reference", type=Path, metavar="FIDELITY_JSON",
                    help="judge retained and kept against this run's full-prefill answers (the base model's, over the "
                         "same split, k, questions and seed offset; a reference whose prompts were others is refused, where it "
                         "kept their digests); speed-ups stay against this model's own full prefill")
    ap.add_argument("--neighbours", type=int, default=0, metavar="M", help="each module encoded after its M nearest (ingest --neighbours)")
    ap.add_argument("--neighbours-present", type=int, default=0, metavar="C",
                    help="read so only where C of them are in the prompt, plain otherwise (ingest --neighbours-present)")
    ap.add_argument("--ttft-point", action="store_true", help="also time the bench split at ~2k context")
    ap.add_argument("--pool", type=Path, nargs="+", metavar="FIDELITY_JSON",
                    help="no model run: pool these runs' fidelity.json (other seeds) into one report")
    ap.add_argument("--rejudge", type=Path, metavar="FIDELITY_JSON",
                    help="no model run: this run's rows judged anew against --reference (a reference made since)")
    ap.add_argument("--out", type=Path, required=True, help="folder for fidelity.json, fidelity.md, the front PNG")
    args = ap.parse_args(argv)
    if args.rejudge:
        if not args.reference or args.pool:
            ap.error("--rejudge needs --reference, the run to judge against, and pools nothing")
        try:
            return write(fidelity_reference.rejudge(json.loads(args.rejudge.read_text()),
                                                    fidelity_reference.load(args.reference)), args.out)
        except ValueError as e:
            ap.error(str(e))
    if args.pool:
        if args.reference:
            ap.error("--reference judges a run as it is made; --pool pools runs made with it (or without)")
        return write(pool([json.loads(f.read_text()) for f in args.pool]), args.out)
    import torch

    from rag_promptcache.engine.planning.encoder import check_mode
    from rag_promptcache.model.loading import load_model
    from rag_promptcache.store import check_codec

    settings = tuple(dict.fromkeys(
        (check_mode(mode or "shared_prefix"), str(Recovery.parse(rec)))
        for mode, _, rec in (s.strip().rpartition("/") for s in args.settings.split(",") if s.strip())))
    cfg = dataclasses.replace(BenchConfig(), fidelity_questions=args.questions, fidelity_ks=tuple(args.k),
                              fidelity_per_kind=args.per_kind, fidelity_settings=settings,
                              fidelity_new_tokens=args.new_tokens, dtype=args.dtype,
                              fidelity_seed_offset=args.seed_offset, fidelity_codec=check_codec(args.codec),
                              fidelity_codecs=tuple(check_codec(c.strip()) for c in args.codecs.split(",") if c.strip()),
                              fidelity_codec_recovery=args.codec_recovery, adapter=args.adapter, fidelity_neighbours=args.neighbours,
                              fidelity_neighbours_present=args.neighbours_present)
    splits = fidelity.GROUPS.get(args.split, (args.split,))
    reference = None
    if args.reference is not None:
        try:
            reference = fidelity_reference.load(args.reference)
            fidelity.check_reference(reference, cfg, splits)  # before the model loads
        except ValueError as e:
            ap.error(str(e))
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype, adapter=args.adapter)
    bench = Bench(model, tok, args.model, cfg, log=lambda m: print(m, flush=True))
    out = fidelity.run(bench, splits, ttft_point=args.ttft_point, reference=reference)
    out.update({"codec": args.codec, "dtype": args.dtype, "threads": args.threads, "seed_offset": args.seed_offset,
                "clock_resolution_s": bench.resolution_s,
                "seconds": round(time.perf_counter() - t0, 1)})
    return write(out, args.out)


def write(out: dict[str, object], folder: Path) -> dict[str, object]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fidelity.json").write_text(json.dumps(out, indent=2) + "\n")
    (folder / "fidelity.md").write_text(report.fidelity_splits_markdown(out) + "\n")
    report.fidelity_front(out, folder / "fidelity_front.png")
    print(report.fidelity_splits_markdown(out), flush=True)
    return out


if __name__ == "__main__":
    main()
