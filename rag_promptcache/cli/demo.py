"""`rag-promptcache demo`: ingest part of the Python language reference that ships with CPython
(`pydoc_data.topics`, no download), ask a few questions, and show TTFT cached vs full prefill.

The documents and questions are `rag_promptcache.rag.sample`, chunked at the corpus's default chunk
size and asked at a user's k (4 by default). Per answer it prints the answer's own TTFT against the
engine's own full prefill of the same prompt (the fastest full prefill this library has; the best of
two runs, so the baseline is never flattered down), which path the planner ran (`cached`, or `full`
where its cost model found a plain prefill faster, engine/planning/costmodel.py) and how many prompt tokens
were computed rather than taken from the cache. An answer is its first paragraph (`sample.DEMO_STOP`), at
most `--max-new-tokens` (64) tokens; one the budget cut off is marked, as `ask` marks it. One untimed
request warms the model first, as a running server would be. The first run ingests into `$RAG_PROMPTCACHE_HOME/demo-corpus`; later runs
find every document unchanged and go straight to the questions.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import SHOWN_DTYPES, DtypeOpt, app, check_name, handle_errors
from rag_promptcache.cli.output import cut_off
from rag_promptcache.rag.sample import DEMO_MAX_NEW_TOKENS  # torch-free: --help shows it


@app.command()
@handle_errors
def demo(
    corpus: Annotated[Path | None, typer.Option(help="Where the demo corpus lives [default: $RAG_PROMPTCACHE_HOME/demo-corpus].")] = None,
    k: Annotated[int, typer.Option("-k", help="Chunks retrieved per question.")] = 4,
    max_new_tokens: Annotated[int, typer.Option(help="Longest answer, in tokens (one cut off is marked); an answer also ends at its first blank line.")] = DEMO_MAX_NEW_TOKENS,
    dtype: DtypeOpt = None,
) -> None:
    """Ingest a slice of the Python reference (first run only), then answer questions from it."""
    check_name("dtype", dtype, SHOWN_DTYPES)  # before torch is imported
    from rag_promptcache.model.loading import dtype_name, parse_dtype
    from rag_promptcache.rag import Corpus, ModelMismatchError, is_corpus
    from rag_promptcache.rag.sample import (DEMO_STOP, QUESTIONS, SOURCE_PREFIX, TOPICS, WARM_UP, check_sample, demo_home,
                                            sample_documents)

    where = corpus or demo_home()
    wanted = parse_dtype(dtype)  # a bad name fails before anything loads
    c = None
    if is_corpus(where):
        c = Corpus.open(where)
        try:
            check_sample(c)  # never adds the sample to a user's own corpus
            if wanted is not None and dtype_name(wanted) != c.manifest.dtype:
                raise ModelMismatchError(f"it was encoded in {c.manifest.dtype}, not {dtype_name(wanted)}")
            c.engine  # noqa: B018 - loads the model and checks its fingerprint against the corpus
        except ModelMismatchError as e:
            if not all(d.source.startswith(SOURCE_PREFIX) for d in c.table.documents()):
                raise  # not a demo corpus: never delete someone's documents
            typer.echo(f"the demo corpus is stale ({e}); rebuilding it", err=True)
            c.close()
            shutil.rmtree(where)
            c = None
    fresh = c is None
    typer.echo(f"{'building' if fresh else 'reusing'} the demo corpus at {where} "
               f"({len(TOPICS)} topics of the Python language reference)")
    c = Corpus.build(sample_documents(), where, dtype=dtype) if c is None else c
    report = c.last_report if fresh else c.add(sample_documents())
    if report is not None and report.num_ingested:
        typer.echo(report.summary())
    c.prepare()
    info = c.info()
    typer.echo(f"corpus: {info['num_documents']} documents, {info['num_modules']} modules, {info['num_tokens']} tokens, "
               f"store {info['store_bytes'] / 2**20:.0f} MiB, model {info['model']}")
    typer.echo(f"each answer is its first paragraph, at most {max_new_tokens} tokens (greedy, k={k}); one the limit cut "
               "is marked\n")
    # untimed warm-up (kernels, buffer pools, the path's cost model) on a question of its own: one of the
    # timed ones would find its whole prompt in the prefix cache, which is not what a new question gets
    c.ask(WARM_UP, k, max_new_tokens=1)
    slower = 0
    for question in QUESTIONS:
        typer.echo(f"Q: {question}")
        typer.echo("A: ", nl=False)
        stream = c.ask_stream(question, k, max_new_tokens=max_new_tokens, stop=DEMO_STOP)
        for piece in stream:
            typer.echo(piece, nl=False)
        answer = stream.answer
        if cut := cut_off(answer.finish_reason, max_new_tokens):
            typer.echo(f"\n   {cut}", nl=False)
        full = min(c.engine.full_prefill_ttft(answer.prompt) for _ in range(2))
        ratio = full / max(answer.ttft_s, 1e-9)
        slower += ratio < 1
        typer.echo(f"\n   sources: {', '.join(dict.fromkeys(answer.sources))}")
        typer.echo(f"   TTFT {answer.ttft_s:.3f}s ({answer.path} path) vs the engine's full prefill {full:.3f}s: "
                   f"{ratio:.1f}x; {answer.computed_tokens} of {answer.prompt_tokens} prompt tokens computed, "
                   f"{answer.cached_tokens} from the cache\n")
    typer.echo(f"{len(QUESTIONS) - slower} of {len(QUESTIONS)} answers reached their first token no later than "
               "the engine's full prefill of the same prompt")
    c.close()
