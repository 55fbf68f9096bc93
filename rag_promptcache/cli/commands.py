"""The corpus commands: ingest, ask, chat, info, remove. Parsing and printing only; the work is in
`rag_promptcache.rag.Corpus`."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import DtypeOpt, app, fail, handle_errors

CorpusOpt = Annotated[Path, typer.Option("--corpus", "-c", help="The corpus directory.", file_okay=False)]
KOpt = Annotated[int, typer.Option("-k", "--k", help="How many chunks to retrieve.")]
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", help="Longest answer, in tokens.")]


def _open(corpus: Path, dtype: str | None = None):
    from rag_promptcache.rag import Corpus

    return Corpus.open(corpus, dtype=dtype)


def _check_k(k: int) -> None:
    if k < 1:
        raise fail(f"-k must be at least 1, got {k}")


def _check_nonempty(c) -> None:
    if not len(c):
        raise fail(f"corpus {c.path} is empty; add documents with: rag-promptcache ingest PATH --corpus {c.path}")


@app.command()
@handle_errors
def ingest(
    paths: Annotated[list[Path], typer.Argument(help="Files or directories (.txt .md .html .pdf .json .jsonl).")],
    corpus: CorpusOpt,
    model: Annotated[str | None, typer.Option(help="Hugging Face model name or path [default: smollm2-135m-instruct].")] = None,
    chunk_tokens: Annotated[int | None, typer.Option(help="Target chunk length in model tokens [default: 256].")] = None,
    overlap: Annotated[int | None, typer.Option(help="Tokens repeated between neighbouring chunks [default: min(32, chunk-tokens/8)].")] = None,
    embedder: Annotated[str | None, typer.Option(help="sentence-transformers name or path [default: all-MiniLM-L6-v2].")] = None,
    index: Annotated[str | None, typer.Option(help="flat (exact, default), hnsw or ivf (large corpora).")] = None,
    field: Annotated[str, typer.Option(help="The text field of .json/.jsonl records.")] = "text",
    max_ingest_tokens: Annotated[int, typer.Option(help="Refuse to add more new tokens than this in one run.")] = 2_000_000,
    dtype: DtypeOpt = None,
) -> None:
    """Build a corpus, or update one: new and changed files are ingested, unchanged ones skipped,
    files gone from an ingested directory removed. Interrupted? Run it again to resume."""
    from rag_promptcache.model.loading import parse_dtype
    from rag_promptcache.rag import Corpus, LoaderWarning, is_corpus

    parse_dtype(dtype)  # a bad name fails before anything is created
    for p in paths:
        if not p.exists():
            raise fail(f"no such file or directory: {p}")
    existed = is_corpus(corpus)
    with warnings.catch_warnings():
        warnings.simplefilter("always", LoaderWarning)
        warnings.showwarning = lambda message, *a, **k: typer.echo(f"warning: {message}", err=True)
        if existed:
            c = Corpus.open(corpus, model=model, embedder=embedder, dtype=dtype)
            for key, value in {"chunk_tokens": chunk_tokens, "overlap": overlap, "index": index}.items():
                if value is not None and value != getattr(c.manifest, key):
                    raise fail(f"corpus {corpus} uses {key}={getattr(c.manifest, key)!r}, not {value!r}; ingest into a new corpus to change it")
            report = c.add(paths, field=field, token_budget=max_ingest_tokens)
        else:
            c = Corpus.build(paths, corpus, model=model, embedder=embedder, chunk_tokens=chunk_tokens, overlap=overlap,
                             index=index, field=field, token_budget=max_ingest_tokens, dtype=dtype)
            report = c.last_report
    info = c.info()
    if report is not None:
        typer.echo(report.summary())
    typer.echo(f"{'updated' if existed else 'created'} corpus {corpus}: {info['num_documents']} documents, "
               f"{info['num_modules']} modules, {info['num_tokens']} tokens")
    c.close()


@app.command()
@handle_errors
def ask(
    question: Annotated[str, typer.Argument(help="The question.")],
    corpus: CorpusOpt,
    k: KOpt = 4,
    stream: Annotated[bool, typer.Option("--stream", help="Print the answer as it is generated.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    max_new_tokens: MaxNewOpt = 256,
    dtype: DtypeOpt = None,
) -> None:
    """Answer a question from the corpus."""
    _check_k(k)
    if not question.strip():
        raise fail("the question is empty")
    c = _open(corpus, dtype)
    _check_nonempty(c)
    if stream and not as_json:
        s = c.ask_stream(question, k, max_new_tokens=max_new_tokens)
        for piece in s:
            typer.echo(piece, nl=False)
        typer.echo()
        answer = s.answer
    else:
        answer = c.ask(question, k, max_new_tokens=max_new_tokens)
    if as_json:
        typer.echo(json.dumps(answer.to_dict()))
    else:
        if not stream:
            typer.echo(answer.answer)
        typer.echo(f"\nsources: {', '.join(dict.fromkeys(answer.sources))}")
        typer.echo(_stats(answer))
    c.close()


def _stats(answer) -> str:
    missed = f", {len(answer.missed_modules)} module(s) recomputed" if answer.missed_modules else ""
    return f"ttft {answer.ttft_s:.2f}s, {answer.cached_tokens} cached / {answer.computed_tokens} computed tokens{missed}"


@app.command()
@handle_errors
def chat(corpus: CorpusOpt, k: KOpt = 4, max_new_tokens: MaxNewOpt = 256, turns: Annotated[int, typer.Option(help="Earlier turns kept as context.")] = 3,
         dtype: DtypeOpt = None) -> None:
    """Chat with the corpus: streaming answers, history, /sources, /quit."""
    _check_k(k)
    c = _open(corpus, dtype)
    _check_nonempty(c)
    typer.echo(f"chatting with {corpus} ({len(c)} modules); /sources shows where the last answer came from, /quit ends")
    history: list[tuple[str, str]] = []
    last = None
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            continue
        if line in ("/quit", "/exit", "/q"):
            break
        if line == "/sources":
            if last is None:
                typer.echo("no answer yet")
            for mid, src, score in zip(last.module_ids, last.sources, last.scores) if last else ():
                typer.echo(f"  {src}  ({mid}, score {score:.3f})")
            continue
        if line.startswith("/"):
            typer.echo("commands: /sources, /quit")
            continue
        s = c.ask_stream(line, k, history=history[-turns:] if turns else (), max_new_tokens=max_new_tokens)
        typer.echo("bot> ", nl=False)
        for piece in s:
            typer.echo(piece, nl=False)
        last = s.answer
        typer.echo(f"\n  [{_stats(last)}]")
        history.append((line, last.answer))
    c.close()


@app.command()
@handle_errors
def info(corpus: CorpusOpt, as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False) -> None:
    """Documents, modules, tokens, store size and model of a corpus."""
    c = _open(corpus)
    facts = c.info()
    c.close()
    if as_json:
        typer.echo(json.dumps(facts))
        return
    typer.echo(f"corpus     {facts['path']}")
    typer.echo(f"documents  {facts['num_documents']}" + (f" ({facts['num_incomplete']} incomplete: run ingest again)" if facts["num_incomplete"] else ""))
    typer.echo(f"modules    {facts['num_modules']} ({facts['num_tokens']} tokens; {facts['num_chunks']} chunks)")
    typer.echo(f"store      {facts['store_bytes'] / 2**20:.1f} MiB")
    typer.echo(f"model      {facts['model']} (fingerprint {facts['fingerprint']}, mode {facts['mode']}, {facts['dtype']})")
    typer.echo(f"embedder   {facts['embedder']} (dim {facts['dim']}), index {facts['index']}")
    typer.echo(f"chunking   {facts['chunk_tokens']} tokens, overlap {facts['overlap']}, max {facts['max_tokens']}")


@app.command()
@handle_errors
def remove(sources: Annotated[list[str], typer.Argument(help="Document paths (or ids) to forget.")], corpus: CorpusOpt) -> None:
    """Remove documents, their modules and their vectors from a corpus."""
    c = _open(corpus)
    for source in sources:
        typer.echo(f"removed {source}: {c.remove(source)} module(s)")
    c.close()
