"""`rag-promptcache eval`: answer fidelity of cached prompts on the user's own corpus and questions.
Parsing and printing only; the work is in `rag_promptcache.rag.fidelity`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import DtypeOpt, RedisOpt, app, fail, handle_errors


@app.command("eval")
@handle_errors
def eval_(
    questions: Annotated[Path, typer.Argument(help='JSON lines: {"question": "...", "answer": "..."}; answer optional.')],
    corpus: Annotated[Path, typer.Option("--corpus", "-c", help="The corpus directory.", file_okay=False)],
    k: Annotated[int, typer.Option("-k", "--k", help="How many chunks to retrieve.")] = 4,
    recovery: Annotated[str | None, typer.Option("--recovery", help="Comma-separated settings, e.g. none,last:1 [default: none and the engine default].")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Answer length compared, in tokens.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    redis_url: RedisOpt = None,
    dtype: DtypeOpt = None,
) -> None:
    """Check, per recovery setting, that cached answers match full prefill's: accuracy against the
    expected answers (retained = cached / full), or agreement with full prefill where none is given,
    and the TTFT speed-up."""
    from rag_promptcache.engine.recovery import DEFAULT_RECOVERY
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.fidelity import evaluate, read_questions

    if k < 1:
        raise fail(f"-k must be at least 1, got {k}")
    if max_new_tokens < 1:
        raise fail(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not questions.is_file():
        raise fail(f"no such file: {questions}")
    specs = [s.strip() for s in (recovery or f"none,{DEFAULT_RECOVERY}").split(",") if s.strip()]
    if not specs:
        raise fail("--recovery names no setting")
    qs = read_questions(questions)
    c = Corpus.open(corpus, redis_url=redis_url, dtype=dtype)
    try:
        reports = evaluate(c, qs, list(dict.fromkeys(specs)), k=k, max_new_tokens=max_new_tokens)
    finally:
        c.close()
    if as_json:
        typer.echo(json.dumps({"corpus": str(corpus), "k": k, "settings": [r.as_dict() for r in reports]}))
        return
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    typer.echo(f"{len(qs)} questions, k={k}, {reports[0].num_with_answer} with an expected answer")
    typer.echo(f"{'recovery':<16} {'full acc':>8} {'cached acc':>10} {'retained':>8} {'agreement':>9} {'speed-up':>8}")
    for r in reports:
        typer.echo(f"{r.recovery:<16} {fmt(r.full_accuracy):>8} {fmt(r.cached_accuracy):>10} {fmt(r.retained):>8} "
                   f"{r.agreement:>9.2f} {r.speedup:>7.1f}x")
