"""`rag-promptcache eval`: answer fidelity of cached prompts on the user's own corpus and questions,
the setting it recommends (`fidelity.recommend`: the rule the engine default was chosen by), the
questions that fail, and `--apply` to make the choice the corpus's. Parsing and printing only; the
work is in `rag_promptcache.rag.fidelity` and `Corpus.set_recovery`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import DtypeOpt, RedisOpt, app, fail, handle_errors

# Shown in --help without importing rag (whose package imports torch); a test holds it equal to
# rag.fidelity.DEFAULT_NEW_TOKENS.
SHOWN_NEW_TOKENS = 64
SHOWN_SETTINGS = ("none", "last:1")  # compared besides the engine default and the corpus's own


@app.command("eval")
@handle_errors
def eval_(
    questions: Annotated[Path, typer.Argument(help='JSON lines: {"question": "...", "answer": "..."}; answer optional.')],
    corpus: Annotated[Path, typer.Option("--corpus", "-c", help="The corpus directory.", file_okay=False)],
    k: Annotated[int, typer.Option("-k", "--k", help="How many chunks to retrieve.")] = 4,
    recovery: Annotated[str | None, typer.Option("--recovery", help="Comma-separated settings, e.g. none,last:1 [default: none, last:1, the engine default and the corpus's].")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Longest answer judged, in tokens (the whole answer up to it).")] = SHOWN_NEW_TOKENS,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the failing questions of every setting, not only the recommended one's.")] = False,
    apply: Annotated[bool, typer.Option("--apply", help="Make the recommended setting this corpus's recovery (ask, chat, serve and the adapters use it unless told otherwise).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (every setting's per-question results).")] = False,
    redis_url: RedisOpt = None,
    dtype: DtypeOpt = None,
) -> None:
    """Check, per recovery setting, that cached answers match full prefill's: accuracy against the
    expected answers (retained = cached / full), or agreement with full prefill where none is given,
    and the TTFT speed-up; then recommend the fastest setting that keeps >= 95% of full prefill's
    right answers and show the questions it gets wrong, the cached and the full answer side by side."""
    from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.fidelity import TARGET_RETAINED, evaluate, read_questions, recommend

    if k < 1:
        raise fail(f"-k must be at least 1, got {k}")
    if max_new_tokens < 1:
        raise fail(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not questions.is_file():
        raise fail(f"no such file: {questions}")
    specs = [s.strip() for s in (recovery or "").split(",") if s.strip()]
    if recovery is not None and not specs:
        raise fail("--recovery names no setting")
    qs = read_questions(questions)
    c = Corpus.open(corpus, redis_url=redis_url, dtype=dtype)
    try:
        if recovery is None:
            specs = [*SHOWN_SETTINGS, DEFAULT_RECOVERY, *([c.manifest.recovery] if c.manifest.recovery else [])]
        specs = list(dict.fromkeys(str(Recovery.parse(s)) for s in specs))  # bad specs fail before any model work
        reports = evaluate(c, qs, specs, k=k, max_new_tokens=max_new_tokens)
        best = recommend(reports)
        applied = c.set_recovery(best.recovery) if apply and best is not None else None
    finally:
        c.close()
    rule = f"the fastest setting that keeps >= {TARGET_RETAINED:.0%} of full prefill's right answers"
    if as_json:
        typer.echo(json.dumps({
            "corpus": str(corpus), "k": k, "max_new_tokens": max_new_tokens, "rule": rule,
            "recommended": None if best is None else best.recovery, "applied": applied,
            "settings": [{**r.as_dict(), "failures": [f.as_dict() for f in r.failures]} for r in reports]}))
    else:
        _print(reports, best, rule, len(qs), k, verbose)
        if applied is not None:
            typer.echo(f"applied: corpus {corpus} now answers with recovery {applied} unless told otherwise")
    if apply and best is None:
        raise fail(f"nothing applied: no setting keeps >= {TARGET_RETAINED:.0%} of full prefill's right answers; "
                   "try more settings (e.g. --recovery last:4,last:6,selective:1.0) or set one with ask/serve --recovery")


def _print(reports, best, rule: str, num_questions: int, k: int, verbose: bool) -> None:
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    typer.echo(f"{num_questions} questions, k={k}, {reports[0].num_with_answer} with an expected answer")
    typer.echo(f"{'recovery':<16} {'full acc':>8} {'cached acc':>10} {'retained':>8} {'agreement':>9} {'speed-up':>8}")
    for r in reports:
        typer.echo(f"{r.recovery:<16} {fmt(r.full_accuracy):>8} {fmt(r.cached_accuracy):>10} {fmt(r.retained):>8} "
                   f"{r.agreement:>9.2f} {r.speedup:>7.1f}x")
    if best is not None:
        typer.echo(f"\nrecommended: {best.recovery} ({rule}: retained {fmt(best.retained)}, {best.speedup:.1f}x); "
                   "`eval --apply` makes it this corpus's")
    else:
        faithful = max(reports, key=lambda r: (r.retained or 0.0, r.speedup))
        typer.echo(f"\nno recommendation: no setting is {rule} (the most faithful, {faithful.recovery}, retains "
                   f"{fmt(faithful.retained)}); try more settings with --recovery")
    shown = reports if verbose else [best or max(reports, key=lambda r: (r.retained or 0.0, r.speedup))]
    for r in shown:
        if not r.failures:
            typer.echo(f"\n{r.recovery}: every question as full prefill answers it")
            continue
        typer.echo(f"\n{r.recovery}: {len(r.failures)} question(s) fail")
        for f in r.failures:
            expected = f" (expected: {f.expected}{'; full prefill is wrong too' if f.full_right is False else ''})" \
                if f.expected is not None else ""
            typer.echo(f"  Q: {f.question}{expected}\n    cached: {_one_line(f.cached)}\n    full:   {_one_line(f.full)}")


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(empty)"
