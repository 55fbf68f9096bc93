"""`rag-promptcache tune`: teach the corpus's model to read its modules encoded on their own, check
the result on held-out questions, and keep it only if cached answers got better. Parsing, the
progress bar (its phases and time left: cli/tune_progress.py) and printing only; the work is in
`rag_promptcache.tune`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import app, fail, handle_errors
from rag_promptcache.cli.tune_progress import Bar, Meter


@app.command("tune")
@handle_errors
def tune(
    corpus: Annotated[Path, typer.Option("--corpus", "-c", help="The corpus directory.", file_okay=False)],
    out: Annotated[Path | None, typer.Option("--out", help="Where the adapter goes [default: CORPUS/tuned].")] = None,
    minutes: Annotated[float, typer.Option("--minutes", help="Stop training after this long, in all across resumed runs (a later run resumes); the checks before and after training come on top.")] = 60.0,
    steps: Annotated[int, typer.Option("--steps", help="Stop training after this many steps.")] = 1000,
    check: Annotated[int, typer.Option("--check", help="Questions made from held-out modules, asked before and after (0: no check).")] = 24,
    questions: Annotated[Path | None, typer.Option("--questions", help='Check on your own questions instead: the JSON lines eval reads, {"question": "...", "answer": "..."} (answer optional).', dir_okay=False)] = None,
    k: Annotated[int, typer.Option("-k", "--k", help="How many chunks each check question retrieves.")] = 4,
    general: Annotated[bool, typer.Option("--general/--corpus-only", help="Mix in this machine's general text (Python's reference, Debian changelogs).")] = True,
    rank: Annotated[int, typer.Option("--rank", help="LoRA rank.")] = 16,
    links: Annotated[int, typer.Option("--links", help="Also learn this many link tokens after each module (recovery links:N; 0: none).")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the samples and the adapter's initialisation.")] = 0,
    restart: Annotated[bool, typer.Option("--restart", help="Start over instead of resuming a checkpoint in --out.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Train a LoRA adapter so the corpus's model answers from independently cached modules as it
    answers with full prefill (distilled from its own full prefill under the engine's block mask),
    then ask questions with and without it: fact lookups made from modules kept out of training, or
    your own (--questions). Resumable: run it again to continue."""
    import shutil

    from rag_promptcache.rag.layout import check_corpus

    check_corpus(corpus)  # a wrong path fails before torch is imported
    if minutes <= 0 or steps < 1:
        raise fail(f"--minutes must be > 0 and --steps >= 1, got {minutes} and {steps}")
    if check < 0 or rank < 1:
        raise fail(f"--check must be >= 0 and --rank >= 1, got {check} and {rank}")
    if k < 1:
        raise fail(f"-k must be at least 1, got {k}")
    if links < 0:
        raise fail(f"--links must be >= 0, got {links}")
    if questions is not None and not questions.is_file():
        raise fail(f"no such file: {questions}")
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.fidelity import read_questions
    from rag_promptcache.rag.models import reencode_command
    from rag_promptcache.tune.corpus import tune_corpus
    from rag_promptcache.tune.train import CHECKPOINT, TuneConfig

    asked = read_questions(questions) if questions is not None else []
    c = Corpus.open(corpus)
    target = out or corpus / "tuned"
    if restart and (target / CHECKPOINT).exists():
        shutil.rmtree(target / CHECKPOINT)
    cfg = TuneConfig(rank=rank, alpha=2 * rank, max_steps=steps, max_seconds=minutes * 60, seed=seed,
                     tokens_per_batch=2048, links=links)
    meter = Meter(cfg.max_seconds, steps)
    bar = Bar(meter, disable=as_json)

    def progress(state, terms):
        bar.progress(state.step, state.seconds, terms)

    try:
        report = tune_corpus(c, target, cfg, general=general, check=check, k=k, questions=asked, progress=progress,
                             phase=bar.phase)
        meter.finish()
        command = reencode_command(c.manifest, corpus, [d.source for d in c.table.documents()], str(report.adapter))
    finally:
        bar.close()
        c.close()
    if as_json:
        typer.echo(json.dumps({**report.as_dict(), "apply_with": command if report.applied else None}))
        return
    typer.echo(f"trained {report.steps} steps on {report.samples} samples; {time.perf_counter() - meter.started:.0f} s "
               f"in all, of which the checks {meter.checked_s:.0f} s (on top of --minutes); adapter in {report.adapter}")
    if report.check is not None:
        ch = report.check
        typer.echo("check: " + ", ".join(f"{n} {kind}" for kind, n in ch.kinds.items()) + f" questions, k = {k}")
        for s in ch.right:
            kept = ch.kept.get(s)
            typer.echo(f"  {s:<11} {ch.right[s]:>3}/{ch.questions} right"
                       + ("" if kept is None else f", kept {kept:.2f}"))
    if report.applied:
        typer.echo(f"use it: {report.reason}. Encode the documents with it into a new corpus (ask, chat and serve "
                   f"then load it from there): {command}")
    else:
        typer.echo(f"not applied: {report.reason}. The corpus keeps its model; the adapter stays in {report.adapter}")
