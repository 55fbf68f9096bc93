"""`rag-promptcache eval`: answer fidelity of cached prompts on the user's own corpus and questions,
the setting it recommends (`fidelity.recommend`: the rule the engine default was chosen by), the
questions that fail, and `--apply` to make the choice the corpus's. Parsing and printing only; the
work is in `rag_promptcache.rag.fidelity` and `Corpus.set_recovery`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import AdapterOpt, DtypeOpt, RedisOpt, app, fail, handle_errors
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
) -> None:
    """Check, per recovery setting, that cached answers match full prefill's: accuracy against the
    expected answers (kept: of full prefill's right answers, the share the setting also gets right, with
    its counts and 95% interval), or agreement with full prefill where none is given, and the TTFT
    speed-up (median of --repeats rounds, and their spread); then recommend the fastest setting that
    keeps >= 95% of full prefill's right answers, say what that rests on, and show the questions it gets
    wrong, the expected, the cached and the full answer side by side. Answers are judged as `ask` gives
    them (the same prompt and repetition control)."""
    from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
    from rag_promptcache.model.adapter import read
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.evaluation import evaluate
    from rag_promptcache.rag.fidelity import TARGET_RETAINED, read_questions, recommend
    from rag_promptcache.rag.models import tuned_recovery

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
    if codec is not None:
        return _eval_codecs(questions, corpus, k, codec, specs, max_new_tokens, apply, as_json, redis_url, dtype, adapter)
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
    rule = f"the fastest setting that keeps >= {TARGET_RETAINED:.0%} of full prefill's right answers"
    if as_json:
        typer.echo(json.dumps({
            "corpus": str(corpus), "k": k, "max_new_tokens": max_new_tokens, "rule": rule, "timing_rounds": repeats,
            "few_answers": _few(reports[0]),
            "recommended": None if best is None else best.recovery, "applied": applied,
            "settings": [{**r.as_dict(), "failures": [f.as_dict() for f in r.failures]} for r in reports],
            "full_prefill_wrong": [{"question": f.question, "expected": list(f.expected or ()), "full": f.full}
                                   for f in reports[0].results if f.full_right is False]}))
    else:
        _print(reports, best, rule, len(qs), k, verbose)
        if applied is not None:
            typer.echo(f"applied: corpus {corpus} now answers with recovery {applied} unless told otherwise")
    if apply and best is None:
        raise fail(f"nothing applied: no setting keeps >= {TARGET_RETAINED:.0%} of full prefill's right answers; "
                   "try more settings (e.g. --recovery last:4,last:6,selective:1.0) or set one with ask/serve --recovery")


def _eval_codecs(questions: Path, corpus: Path, k: int, codec: str, specs: list[str], max_new_tokens: int,
                 apply: bool, as_json: bool, redis_url: str | None, dtype: str | None, adapter: str) -> None:
    """`eval --codec`: each codec's answers against fp16 modules', and the smallest that keeps them."""
    from rag_promptcache.engine.planning.recovery import Recovery
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.codec_eval import TARGET_KEPT, TARGET_RETAINED, evaluate_codecs, recommend_codec
    from rag_promptcache.rag.fidelity import read_questions
    from rag_promptcache.store import check_codec

    codecs = [check_codec(c.strip()) for c in codec.split(",") if c.strip()]
    if not codecs:
        raise fail("--codec names no codec")
    if len(specs) > 1:
        raise fail(f"--codec compares codecs under one recovery; --recovery names {len(specs)}: {', '.join(specs)}")
    if apply:
        raise fail("--apply sets a recovery; a corpus's codec is set when it is built: ingest into a new corpus with --codec")
    qs = read_questions(questions)
    c = Corpus.open(corpus, redis_url=redis_url, dtype=dtype, adapter=adapter)
    try:
        rec = str(Recovery.parse(specs[0])) if specs else str(c.prepare().recovery)
        reports = evaluate_codecs(c, qs, codecs, rec, k=k, max_new_tokens=max_new_tokens)
    finally:
        c.close()
    best = recommend_codec(reports)
    rule = (f"the fewest bytes per token that keeps retained >= {TARGET_RETAINED:.2f} and kept >= {TARGET_KEPT:.2f} "
            "against fp16 modules")
    if as_json:
        typer.echo(json.dumps({"corpus": str(corpus), "k": k, "recovery": rec, "rule": rule,
                               "recommended": None if best is None else best.codec,
                               "codecs": [{**r.as_dict(), "failures": [f.as_dict() for f in r.report.failures]}
                                          for r in reports]}))
        return
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    r0 = reports[0].report
    typer.echo(f"{len(qs)} questions, k={k}, recovery {rec}; fp16 modules answer {r0.full_correct} of "
               f"{r0.num_with_answer} with an expected answer right")
    typer.echo(f"{'codec':<10} {'bytes/token':>11} {'right':>6} {'kept':>6} {'retained':>8} {'agreement':>9} {'TTFT s':>7}")
    for r in reports:
        typer.echo(f"{r.codec:<10} {r.bytes_per_token:>11.0f} {r.report.cached_correct:>6} {fmt(r.report.kept):>6} "
                   f"{fmt(r.report.retained):>8} {r.report.agreement:>9.2f} {r.report.cached_ttft_s:>7.3f}")
    typer.echo("kept: of fp16 modules' right answers, the share the codec also gets right; retained: codec right / fp16 right")
    if best is None:
        typer.echo(f"\nno recommendation: no codec is {rule}")
    else:
        typer.echo(f"\nrecommended: {best.codec} ({rule}: {best.bytes_per_token:.0f} bytes per token); a new corpus "
                   f"takes it with `ingest --codec {best.codec}`")
    for r in reports:
        if r.report.failures:
            typer.echo(f"\n{r.codec}: {len(r.report.failures)} question(s) fail")
            for f in r.report.failures:
                expected = f"\n    expected: {_expected(f.expected)}" if f.expected is not None else ""
                typer.echo(f"  Q: {f.question}{expected}\n    {r.codec + ':':<9} {_one_line(f.cached)}\n"
                           f"    fp16:     {_one_line(f.full)}")


def _print(reports, best, rule: str, num_questions: int, k: int, verbose: bool) -> None:
    from rag_promptcache.rag.fidelity import MIN_RIGHT

    first = reports[0]
    answered = first.num_with_answer
    typer.echo(f"{num_questions} questions, k={k}, {answered} with an expected answer"
               + (f"; full prefill answers {first.full_correct} of them right" if answered else ""))
    typer.echo(f"{'recovery':<16} {'full right':>11} {'cached right':>13} {'kept':>11} {'95% interval':>13} "
               f"{'retained':>9} {'agreement':>10} {'speed-up':>9} {'rounds':>13}")
    for r in reports:
        full, cached = ((f"{r.full_correct}/{answered}", f"{r.cached_correct}/{answered}") if answered
                        else ("n/a", "n/a"))
        if r.error is not None:
            typer.echo(f"{r.recovery:<16} {full:>11} failed: {_one_line(r.error)}")
            continue
        retained = f"{r.cached_correct}/{r.full_correct}" if answered else "n/a"
        agree = f"{sum(x.agrees for x in r.results)}/{r.num_questions}"
        typer.echo(f"{r.recovery:<16} {full:>11} {cached:>13} {_kept(r):>11} {_interval(r):>13} {retained:>9} "
                   f"{agree:>10} {describe(r.speedup, '>8.1f', 'x'):>9} {_spread(r):>13}")
    typer.echo("kept: of full prefill's right answers, how many the setting also gets right (the rule's measure; "
               "without expected answers, the answers that agree with full prefill's); retained: cached right / full right; "
               "speed-up: median TTFT of full prefill over the setting's, rounds: each timing round's speed-up")
    if _few(first):
        n = first.kept_counts[1]
        step = f"{1 / n:.2f}" if n else "all"
        typer.echo(f"\nwarning: full prefill answered only {n} question(s) right, fewer than {MIN_RIGHT}: kept moves by {step} "
                   f"with each answer and is only known to lie in its 95% interval. Add questions with expected answers "
                   f"until full prefill gets {MIN_RIGHT} or more right before trusting the recommendation."
                   if answered else
                   f"\nwarning: only {n} question(s), fewer than {MIN_RIGHT}: agreement moves by {step} with each answer "
                   f"and is only known to lie in its 95% interval. Ask {MIN_RIGHT} or more before trusting the recommendation.")
    shaky = [r for r in reports if r.error is None and len(r.speedup_rounds) > 1 and max(r.speedup_rounds) > UNSTABLE * min(r.speedup_rounds)]
    if shaky:
        typer.echo(f"\nwarning: the speed-ups moved between timing rounds ({', '.join(f'{r.recovery} {_spread(r)}' for r in shaky)}): "
                   "the machine was busy; rerun on a quiet machine or raise --repeats.")
    faithful = lambda r: (r.error is None, r.kept or 0.0, (r.speedup or 0.0) if r.error is None else 0.0)  # noqa: E731
    if best is not None:
        typer.echo(f"\nrecommended: {best.recovery} ({rule}): it keeps {_kept(best)} (95% interval {_interval(best)}) "
                   f"at {describe(best.speedup, '.1f', 'x')}. {_rests_on(best)}. `eval --apply` makes it this corpus's")
    else:
        most = max(reports, key=faithful)
        typer.echo(f"\nno recommendation: no setting is {rule} (the most faithful, {most.recovery}, keeps "
                   f"{_kept(most)}); try more settings with --recovery")
    for r in reports if verbose else [best or max(reports, key=faithful)]:
        if r.error is not None:
            typer.echo(f"\n{r.recovery}: failed, no answers: {_one_line(r.error)}")
            continue
        if not r.failures:
            typer.echo(f"\n{r.recovery}: every question as full prefill answers it")
            continue
        typer.echo(f"\n{r.recovery}: {len(r.failures)} question(s) fail")
        for f in r.failures:
            _print_miss(f, f"{'wrong' if f.cached_right is False else 'differs'}")
    full_misses = [f for f in reports[0].results if f.full_right is False]
    if full_misses:  # the same for every setting: full prefill's answers are the reference
        typer.echo(f"\nfull prefill: {len(full_misses)} question(s) wrong (check the expected answers)")
        for f in full_misses:
            typer.echo(f"  Q: {f.question}\n    expected: {_expected(f.expected)}\n    full:     {_one_line(f.full)}")


def _few(report) -> bool:
    """Whether the share the rule reads rests on fewer answers than rag.fidelity.MIN_RIGHT."""
    from rag_promptcache.rag.fidelity import MIN_RIGHT

    return report.kept_counts[1] < MIN_RIGHT


def _kept(r) -> str:
    kept, of = r.kept_counts
    return f"{kept}/{of} = {kept / of:.2f}" if of else "n/a"


def _interval(r) -> str:
    return "n/a" if r.kept_interval is None else "{:.2f}-{:.2f}".format(*r.kept_interval)


def _spread(r) -> str:
    rounds = r.speedup_rounds
    return f"{min(rounds):.1f}-{max(rounds):.1f}x" if rounds else "n/a"


def _rests_on(r) -> str:
    """What a recommendation rests on: how many answers, and how steady its speed-up was."""
    n = r.kept_counts[1]
    what = f"{n} right answers of full prefill" if r.num_with_answer else f"{n} questions (no expected answers: agreement)"
    timing = (f"the speed-up ranged {_spread(r)} over {len(r.speedup_rounds)} timing rounds" if r.speedup_rounds
              else "the speed-up was timed once")
    return f"It rests on {what}{', too few to be sure (see the warning)' if _few(r) else ''}; {timing}"


def _print_miss(f, why: str) -> None:
    expected = f"\n    expected: {_expected(f.expected)}" if f.expected is not None else ""
    full_note = " (wrong too)" if f.full_right is False else ""
    typer.echo(f"  Q: {f.question} [{why}]{expected}\n    cached:   {_one_line(f.cached)}\n"
               f"    full:     {_one_line(f.full)}{full_note}")


def _expected(answers: tuple[str, ...]) -> str:
    return " or ".join(json.dumps(a) for a in answers)


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(empty)"
