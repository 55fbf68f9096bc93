"""`rag-promptcache eval --byproduct`: each recovery's answers over plain module entries and over the entries
other questions' full prefills leave (what a corpus ingested `--kv lazy --byproduct` keeps), against full
prefill, written as plain `eval` writes a recovery's (cli/eval_format.py), and whether such a corpus would
keep the answers. Parsing and printing only; the work is in `rag_promptcache.rag.byproduct_eval`."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from rag_promptcache.cli.app import fail
from rag_promptcache.cli.eval_format import (few, few_warning, interval_text, kept_text, miss_text, no_recommendation,
                                             rests_on, retained_text, summary_line)


def eval_byproduct(questions: Path, corpus: Path, k: int, specs: list[str], max_new_tokens: int, apply: bool,
                   as_json: bool, redis_url: str | None, dtype: str | None, adapter: str) -> None:
    """Plain and by-product entries under each recovery, and whether by-product entries keep the answers."""
    if apply:
        raise fail("--apply sets a recovery; a corpus keeps by-product entries when it is built: ingest into a new "
                   "corpus with --kv lazy --byproduct")
    from rag_promptcache.engine.planning.recovery import Recovery
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.byproduct_eval import PREFIX, evaluate_byproduct, recommend_byproduct
    from rag_promptcache.rag.fidelity import RULE, read_questions

    qs = read_questions(questions)
    c = Corpus.open(corpus, redis_url=redis_url, dtype=dtype, adapter=adapter)
    try:
        default = str(c.prepare().recovery)
        specs = list(dict.fromkeys(str(Recovery.parse(s)) for s in (specs or ["none", default])))
        reports = evaluate_byproduct(c, qs, specs, k=k, max_new_tokens=max_new_tokens)
    finally:
        c.close()
    best = recommend_byproduct(reports)
    target = f"keeps {RULE} against full prefill"
    rule = f"the first by-product setting (in the order asked) that {target}"
    byproducts = [r for r in reports if r.recovery.startswith(PREFIX)]
    why_none = None if best is not None else no_recommendation(
        reports[0], max(byproducts, key=lambda r: (r.kept or 0.0, r.retained or 0.0), default=None), target,
        "by-product setting", hint="Keep plain entries (a lazy corpus without --byproduct), or try a recovery "
                                   "that recomputes more (--recovery).")
    if as_json:
        typer.echo(json.dumps({"corpus": str(corpus), "k": k, "rule": rule, "few_answers": few(reports[0]),
                               "recommended": None if best is None else best.recovery.removeprefix(PREFIX),
                               "no_recommendation": why_none,
                               "settings": [{**r.as_dict(), "byproduct": r.recovery.startswith(PREFIX),
                                             "meets": r.meets, "failures": [f.as_dict() for f in r.failures]}
                                            for r in reports]}))
        return
    first = reports[0]
    answered = first.num_with_answer
    typer.echo(summary_line(len(qs), k, first, "full prefill answers"))
    typer.echo(f"{'entries, recovery':<26} {'full right':>11} {'cached right':>13} {'kept':>11} {'95% interval':>13} "
               f"{'retained':>9} {'agreement':>10}")
    for r in reports:
        full, cached = ((f"{r.full_correct}/{answered}", f"{r.cached_correct}/{answered}") if answered
                        else ("n/a", "n/a"))
        name = (f"by-product, {r.recovery.removeprefix(PREFIX)}" if r.recovery.startswith(PREFIX)
                else f"plain, {r.recovery}")
        agree = f"{sum(x.agrees for x in r.results)}/{r.num_questions}"
        typer.echo(f"{name:<26} {full:>11} {cached:>13} {kept_text(r):>11} {interval_text(r):>13} "
                   f"{retained_text(r):>9} {agree:>10}")
    typer.echo("by-product: each module read from the entry another question's full prefill left of it (a module "
               "no other question retrieved: its plain entry); both read as stored, so as fast as each other")
    if (warning := few_warning(first)) is not None:
        typer.echo(f"\n{warning}")
    if best is None:
        typer.echo(f"\n{why_none}")
        return
    rec = best.recovery.removeprefix(PREFIX)
    typer.echo(f"\nrecommended: by-product entries with recovery {rec} ({rule}): it keeps {kept_text(best)} (95% "
               f"interval {interval_text(best)}). {rests_on(best)}. A new corpus of these documents keeps them with "
               f"`ingest --kv lazy --byproduct`, answering with --recovery {rec} (or `eval --apply` on it)")
    failing = best.failures
    if failing:
        typer.echo(f"\n{len(failing)} question(s) the recommended setting gets wrong")
        for f in failing:
            typer.echo(miss_text(f, [("full", f.full), ("cached", f.cached)]))
