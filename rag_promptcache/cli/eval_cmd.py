"""`rag-promptcache eval`: answer fidelity of cached prompts on the user's own corpus and questions,
the setting it recommends (`fidelity.recommend`: the rule the engine default was chosen by), the
questions that fail, and `--apply` to make the choice the corpus's. Parsing and printing only; the
work is in `rag_promptcache.rag.fidelity` and `Corpus.set_recovery`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import SHOWN_DTYPES, AdapterOpt, DtypeOpt, RedisOpt, app, check_name, fail, handle_errors
from rag_promptcache.cli.eval_format import (few, few_warning, interval_text, kept_text, miss_text, no_recommendation,
                                             one_line, rests_on, retained_text, retains_text, summary_line)
from rag_promptcache.timing import describe

# Shown in --help without importing rag (whose package imports torch); a test holds it equal to
# rag.fidelity.DEFAULT_NEW_TOKENS.
SHOWN_NEW_TOKENS = 64
SHOWN_ROUNDS = 3  # rag.evaluation.TIMING_ROUNDS, held equal by the same test
SHOWN_SETTINGS = ("none", "last:1")  # compared besides the engine default and the corpus's own
UNSTABLE = 1.25  # a setting whose fastest timing round is this much faster than its slowest is flagged


@app.command("eval")
@handle_errors
def eval_(
    questions: Annotated[Path, typer.Argument(help='JSON lines: {"question": "...", "answer": "..."}; answer optional, a list for several accepted answers; case, "%"/"percent", number words and 1,234/1234 do not matter.')],
    corpus: Annotated[Path, typer.Option("--corpus", "-c", help="The corpus directory.", file_okay=False)],
    k: Annotated[int, typer.Option("-k", "--k", help="How many chunks to retrieve.")] = 4,
    recovery: Annotated[str | None, typer.Option("--recovery", help="Comma-separated settings, e.g. none,last:1 [default: none, last:1, the engine default and the corpus's].")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Longest answer judged, in tokens (the whole answer up to it).")] = SHOWN_NEW_TOKENS,
    repeats: Annotated[int, typer.Option("--repeats", help="Rounds of TTFT timings (one token each, every question and setting, no prefix reused); the speed-up is the median over them, and their spread is shown.")] = SHOWN_ROUNDS,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the failing questions of every setting, not only the recommended one's.")] = False,
    apply: Annotated[bool, typer.Option("--apply", help="Make the recommended setting this corpus's recovery (ask, chat, serve and the adapters use it unless told otherwise).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (every setting's per-question results).")] = False,
    redis_url: RedisOpt = None,
    dtype: DtypeOpt = None,
    adapter: AdapterOpt = "default",
    codec: Annotated[str | None, typer.Option("--codec", help="Comma-separated KV codecs, e.g. int8,int4,cachegen: answer the questions over modules decoded from each, against the same modules in fp16, with one recovery (--recovery, else the corpus's), and recommend the smallest that keeps the answers.")] = None,
    byproduct: Annotated[bool, typer.Option("--byproduct", help="Answer each recovery (--recovery, else none and the engine default) over plain entries and over the entries other questions' full prefills leave of each module (what `ingest --kv lazy --byproduct` keeps), against full prefill, and say whether such a corpus keeps the answers.")] = False,
) -> None:
    """Check, per recovery setting, that cached answers match full prefill's: accuracy against the
    expected answers (kept: of full prefill's right answers, the share the setting also gets right, with
    its counts and 95% interval), or agreement with full prefill where none is given, and the TTFT
    speed-up (median of --repeats rounds, and their spread); then recommend the fastest setting that
    retains >= 95% of full prefill's right answers and keeps >= 90% of them, say what that rests on, and
    show the questions it gets wrong, the expected, the cached and the full answer side by side. Answers
    are judged as `ask` gives them (the same prompt and repetition control)."""
    if k < 1:
        raise fail(f"-k must be at least 1, got {k}")
    if repeats < 1:
        raise fail(f"--repeats must be at least 1, got {repeats}")
    if max_new_tokens < 1:
        raise fail(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not questions.is_file():
        raise fail(f"no such file: {questions}")
    specs = [s.strip() for s in (recovery or "").split(",") if s.strip()]
    if recovery is not None and not specs:
        raise fail("--recovery names no setting")
    from rag_promptcache.rag.layout import check_corpus

    check_name("dtype", dtype, SHOWN_DTYPES)
    check_corpus(corpus)  # usage and path errors come back before torch is imported
    if codec is not None and byproduct:
        raise fail("--codec and --byproduct are two evaluations; run them one at a time")
    if byproduct:
        from rag_promptcache.cli.eval_byproduct import eval_byproduct

        return eval_byproduct(questions, corpus, k, specs, max_new_tokens, apply, as_json, redis_url, dtype, adapter)
    if codec is not None:
        from rag_promptcache.cli.eval_codecs import eval_codecs

        return eval_codecs(questions, corpus, k, codec, specs, max_new_tokens, apply, as_json, redis_url, dtype, adapter)
    from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
    from rag_promptcache.model.adapter import read
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.evaluation import evaluate
    from rag_promptcache.rag.fidelity import RULE, read_questions, recommend
    from rag_promptcache.rag.models import tuned_recovery

    qs = read_questions(questions)
    c = Corpus.open(corpus, redis_url=redis_url, dtype=dtype, adapter=adapter)
    try:
        if recovery is None:
            default = tuned_recovery(c.adapter_path) or DEFAULT_RECOVERY  # the engine's default with this corpus's adapter
            trained = read(Path(c.adapter_path)).num_links if c.adapter_path else 0  # links: measured where trained
            specs = [*SHOWN_SETTINGS, *([f"links:{trained}"] if trained else []), default,
                     *([c.manifest.recovery] if c.manifest.recovery else [])]
        specs = list(dict.fromkeys(str(Recovery.parse(s)) for s in specs))  # bad specs fail before any model work
        reports = evaluate(c, qs, specs, k=k, max_new_tokens=max_new_tokens, rounds=repeats)
        best = recommend(reports)
        applied = c.set_recovery(best.recovery) if apply and best is not None else None
    finally:
        c.close()
    rule = f"the fastest setting that passes the rule ({RULE}, of full prefill's right answers)"
    why_none = None if best is not None else no_recommendation(
        reports[0], max(reports, key=_faithful), f"passes the rule ({RULE})", "setting",
        hint="Try more settings with --recovery.")
    if as_json:
        typer.echo(json.dumps({
            "corpus": str(corpus), "k": k, "max_new_tokens": max_new_tokens, "rule": rule, "timing_rounds": repeats,
            "few_answers": few(reports[0]),
            "recommended": None if best is None else best.recovery, "applied": applied,
            "no_recommendation": why_none,
            "settings": [{**r.as_dict(), "failures": [f.as_dict() for f in r.failures]} for r in reports],
            "full_prefill_wrong": [{"question": f.question, "expected": list(f.expected or ()), "full": f.full}
                                   for f in reports[0].results if f.full_right is False]}))
    else:
        _print(reports, best, rule, why_none, len(qs), k, verbose)
        if applied is not None:
            typer.echo(f"applied: corpus {corpus} now answers with recovery {applied} unless told otherwise")
    if apply and best is None:
        raise fail(f"nothing applied: {why_none.removeprefix('no recommendation: ')} (a corpus's recovery can also be "
                   "given to ask and serve with --recovery)")


def _faithful(r) -> tuple[bool, float, float]:
    return r.error is None, r.kept or 0.0, (r.speedup or 0.0) if r.error is None else 0.0


def _print(reports, best, rule: str, why_none: str | None, num_questions: int, k: int, verbose: bool) -> None:
    first = reports[0]
    answered = first.num_with_answer
    typer.echo(summary_line(num_questions, k, first, "full prefill answers"))
    typer.echo(f"{'recovery':<16} {'full right':>11} {'cached right':>13} {'kept':>11} {'95% interval':>13} "
               f"{'retained':>9} {'agreement':>10} {'speed-up':>9} {'rounds':>13}")
    for r in reports:
        full, cached = ((f"{r.full_correct}/{answered}", f"{r.cached_correct}/{answered}") if answered
                        else ("n/a", "n/a"))
        if r.error is not None:
            typer.echo(f"{r.recovery:<16} {full:>11} failed: {one_line(r.error)}")
            continue
        agree = f"{sum(x.agrees for x in r.results)}/{r.num_questions}"
        typer.echo(f"{r.recovery:<16} {full:>11} {cached:>13} {kept_text(r):>11} {interval_text(r):>13} "
                   f"{retained_text(r):>9} {agree:>10} {describe(r.speedup, '>8.1f', 'x'):>9} {_spread(r):>13}")
    typer.echo("kept: of full prefill's right answers, how many the setting also gets right (without "
               "expected answers, the answers that agree with full prefill's); retained: cached right / full right (the "
               "rule reads both); "
               "speed-up: median TTFT of full prefill over the setting's, rounds: each timing round's speed-up")
    if (warning := few_warning(first)) is not None:
        typer.echo(f"\n{warning}")
    shaky = [r for r in reports if r.error is None and len(r.speedup_rounds) > 1 and max(r.speedup_rounds) > UNSTABLE * min(r.speedup_rounds)]
    if shaky:
        typer.echo(f"\nwarning: the speed-ups moved between timing rounds ({', '.join(f'{r.recovery} {_spread(r)}' for r in shaky)}): "
                   "the machine was busy; rerun on a quiet machine or raise --repeats.")
    if best is not None:
        timing = (f"the speed-up ranged {_spread(best)} over {len(best.speedup_rounds)} timing rounds"
                  if best.speedup_rounds else "the speed-up was timed once")
        typer.echo(f"\nrecommended: {best.recovery} ({rule}): it {retains_text(best)}keeps {kept_text(best)} (95% interval "
                   f"{interval_text(best)}) at {describe(best.speedup, '.1f', 'x')}. {rests_on(best, timing=timing)}. "
                   "`eval --apply` makes it this corpus's")
    else:
        typer.echo(f"\n{why_none}")
    for r in reports if verbose else [best or max(reports, key=_faithful)]:
        if r.error is not None:
            typer.echo(f"\n{r.recovery}: failed, no answers: {one_line(r.error)}")
            continue
        if not r.failures:
            typer.echo(f"\n{r.recovery}: every question as full prefill answers it")
            continue
        typer.echo(f"\n{r.recovery}: {len(r.failures)} question(s) fail")
        for f in r.failures:
            full_note = " (wrong too)" if f.full_right is False else ""
            typer.echo(miss_text(f, [("cached", f.cached), ("full", f.full + full_note)],
                                 "wrong" if f.cached_right is False else "differs"))
    full_misses = [f for f in reports[0].results if f.full_right is False]
    if full_misses:  # the same for every setting: full prefill's answers are the reference
        typer.echo(f"\nfull prefill: {len(full_misses)} question(s) wrong (check the expected answers)")
        for f in full_misses:
            typer.echo(miss_text(f, [("full", f.full)]))


def _spread(r) -> str:
    rounds = r.speedup_rounds
    return f"{min(rounds):.1f}-{max(rounds):.1f}x" if rounds else "n/a"
