"""The corpus commands: ingest, ask, chat, info, remove. Parsing and printing only; the work is in
`rag_promptcache.rag.Corpus`."""

from __future__ import annotations

import json
import os
import select
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import SHOWN_CODECS, SHOWN_DTYPES, AdapterOpt, DtypeOpt, RedisOpt, app, check_name, fail, handle_errors
from rag_promptcache.cli.output import cut_off
from rag_promptcache.rag.loaders import SUFFIXES  # torch-free: --help lists what the loaders take

# Help shows the corpus default (rag_promptcache.rag.repetition.DEFAULT_NO_REPEAT_NGRAM; a test holds
# them equal) without importing rag, whose package imports torch: `--help` stays fast.
SHOWN_NO_REPEAT_NGRAM = 6

CorpusOpt = Annotated[Path, typer.Option("--corpus", "-c", help="The corpus directory.", file_okay=False)]
KOpt = Annotated[int, typer.Option("-k", "--k", help="How many chunks to retrieve.")]
SHOWN_DOCUMENTS = 20
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", help="Longest answer, in tokens.")]


def _open(corpus: Path, redis_url: str | None = None, dtype: str | None = None, adapter: str = "default"):
    from rag_promptcache.rag.layout import check_corpus

    check_name("dtype", dtype, SHOWN_DTYPES)
    check_corpus(corpus)  # a wrong path or name fails before torch is imported (seconds)
    from rag_promptcache.rag import Corpus

    return Corpus.open(corpus, redis_url=redis_url, dtype=dtype, adapter=adapter)


def _check_k(k: int) -> None:
    if k < 1:
        raise fail(f"-k must be at least 1, got {k}")


def _check_nonempty(c) -> None:
    if not len(c):
        raise fail(f"corpus {c.path} is empty; add documents with: rag-promptcache ingest PATH --corpus {c.path}")


@app.command()
@handle_errors
def ingest(
    paths: Annotated[list[Path], typer.Argument(help=f"Files or directories ({' '.join(SUFFIXES)}; a directory: every such file under it).")],
    corpus: CorpusOpt,
    model: Annotated[str | None, typer.Option(help="Hugging Face model name or path [default: smollm2-135m-instruct].")] = None,
    chunk_tokens: Annotated[int | None, typer.Option(help="Target chunk length in model tokens [default: 256].")] = None,
    overlap: Annotated[int | None, typer.Option(help="Tokens repeated between neighbouring chunks [default: min(32, chunk-tokens/8)].")] = None,
    embedder: Annotated[str | None, typer.Option(help="sentence-transformers name or path [default: all-MiniLM-L6-v2].")] = None,
    index: Annotated[str | None, typer.Option(help="flat (exact, default), hnsw or ivf (large corpora).")] = None,
    field: Annotated[str, typer.Option(help="The text field of .json/.jsonl records.")] = "text",
    id_field: Annotated[str, typer.Option(help="The .json/.jsonl field that names a record (in sources and remove).")] = "id",
    max_ingest_tokens: Annotated[int, typer.Option(help="Refuse to add more new tokens than this in one run.")] = 2_000_000,
    redis_url: RedisOpt = None,
    ray: Annotated[bool, typer.Option("--ray", help="Embed and encode on a Ray cluster (needs the ray extra of rag-promptcache).")] = False,
    ray_address: Annotated[str | None, typer.Option(help="With --ray: 'auto' (a running cluster), ray://host:10001 (default: start a local one).")] = None,
    workers: Annotated[int, typer.Option(help="With --ray: Ray actors, each loading the model once.")] = 2,
    cpus_per_worker: Annotated[float, typer.Option(help="With --ray: CPUs (and torch threads) per worker.")] = 1.0,
    ray_kv: Annotated[str, typer.Option(help="With --ray: who writes module KV: auto, workers (shared Redis or disk) or driver.")] = "auto",
    dtype: DtypeOpt = None,
    adapter: AdapterOpt = "default",
    instructions: Annotated[str | None, typer.Option(help="The system text every prompt of a new corpus starts with: TEXT, or @FILE to read it from a file [default: answer from the documents, say so when they do not say].", show_default=False)] = None,
    codec: Annotated[str | None, typer.Option(help=f"How a new corpus stores module KV in memory, on disk and in Redis: {', '.join(SHOWN_CODECS)} [default: fp16]; `eval --codec` measures what one does to answers (docs/stores.md).", show_default=False)] = None,
) -> None:
    """Build a corpus, or update one: new and changed files are ingested, unchanged ones skipped,
    files gone from an ingested directory removed. Interrupted? Run it again to resume (with or without --ray).
    Before a large ingest it prints the store's expected size per codec, and its size when done."""
    for p in paths:  # file and name errors first: they need nothing imported
        if not p.exists():
            raise fail(f"no such file or directory: {p}")
    check_name("dtype", dtype, SHOWN_DTYPES)
    check_name("codec", codec, SHOWN_CODECS, "valid codecs")
    from rag_promptcache.model.loading import parse_dtype
    from rag_promptcache.rag import is_corpus

    ray_opts = None
    if ray:
        from rag_promptcache.rag.distributed import RayOptions

        quiet_ray(ray_address)

        ray_opts = RayOptions(address=ray_address, workers=workers, cpus_per_worker=cpus_per_worker, kv=ray_kv)
    elif ray_address is not None:
        raise fail("--ray-address needs --ray")

    parse_dtype(dtype)  # a bad name fails before anything is created
    if codec is not None:
        from rag_promptcache.store.codecs import check_codec

        check_codec(codec)
    instructions = _read_instructions(instructions)
    existed = is_corpus(corpus)
    try:
        c, report = _ingest(paths, corpus, existed, model, chunk_tokens, overlap, embedder, index, field, id_field,
                            max_ingest_tokens, redis_url, ray_opts, dtype, adapter, instructions, codec)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted; committed work is kept, run the same command again to resume", err=True)
        raise typer.Exit(130) from None
    from rag_promptcache.cli.output import mib

    info = c.info()
    if report is not None:
        typer.echo(report.summary())
    typer.echo(f"{'updated' if existed else 'created'} corpus {corpus}: {info['num_documents']} documents, "
               f"{info['num_modules']} modules, {info['num_tokens']} tokens; store {mib(info['store_bytes'])} "
               f"({info['codec']})")
    c.close()
    if report is not None and report.failed:
        raise fail(f"{len(report.failed)} file(s) failed and are kept incomplete; run the same command again to retry them")


def _print_estimate(estimate) -> None:
    """Before a large ingest (`rag.ingest.LARGE_INGEST_TOKENS`): its expected store size in each codec,
    the corpus's marked."""
    from rag_promptcache.cli.output import mib

    sizes = ", ".join(f"{c} {mib(b)}{' (this corpus)' if c == estimate.codec else ''}"
                      for c, b in estimate.bytes_per_codec)
    typer.echo(f"about {estimate.num_tokens:,} new tokens; expected store growth per codec: {sizes}", err=True)


def _read_instructions(value: str | None) -> str | None:
    """--instructions TEXT, or @FILE: the file's text."""
    if value is None:
        return None
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise fail(f"--instructions {value}: no such file: {path}")
        value = path.read_text(encoding="utf-8")
    if not value.strip():
        raise fail("--instructions is empty")
    return value.strip()


def quiet_ray(address: str | None) -> None:
    """Ray's notices the user of `ingest --ray` cannot act on, off for this process: the token-auth
    warning of the local cluster Ray starts (its own default mode, token, set explicitly; a cluster
    given by --ray-address keeps its settings), and colour codes in worker log lines that do not go
    to a terminal. Variables the user set win."""
    if address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def _ingest(paths, corpus, existed, model, chunk_tokens, overlap, embedder, index, field, id_field, max_ingest_tokens,
            redis_url, ray_opts, dtype, adapter, instructions, codec):
    from rag_promptcache.rag import Corpus, LoaderWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", LoaderWarning)
        warnings.showwarning = lambda message, *a, **k: typer.echo(f"warning: {message}", err=True)
        if existed:
            c = Corpus.open(corpus, model=model, embedder=embedder, redis_url=redis_url, dtype=dtype, adapter=adapter)
            for key, value in {"chunk_tokens": chunk_tokens, "overlap": overlap, "index": index}.items():
                if value is not None and value != getattr(c.manifest, key):
                    raise fail(f"corpus {corpus} uses {key}={getattr(c.manifest, key)!r}, not {value!r}; ingest into a new corpus to change it")
            if codec is not None and codec != c.manifest.codec:
                raise fail(f"corpus {corpus} stores KV as {c.manifest.codec}, not {codec}; ingest into a new corpus "
                           "with --codec to change it")
            if instructions is not None and instructions != c.manifest.instructions:
                raise fail(f"corpus {corpus} has other instructions (`info` shows them); every module is encoded after "
                           "them, so changing them means encoding every module again: ingest into a new corpus with "
                           "--instructions")
            report = c.add(paths, field=field, id_field=id_field, token_budget=max_ingest_tokens, ray=ray_opts,
                           on_estimate=_print_estimate)
        else:
            c = Corpus.build(paths, corpus, model=model, embedder=embedder, chunk_tokens=chunk_tokens, overlap=overlap,
                             index=index, field=field, id_field=id_field, token_budget=max_ingest_tokens,
                             redis_url=redis_url, ray=ray_opts, dtype=dtype, adapter=adapter,
                             instructions=instructions, codec=codec, on_estimate=_print_estimate)
            report = c.last_report
    return c, report


def _prompt(text: str) -> str:
    """`input(text)` that notices Ctrl-C at once. The kernel may deliver SIGINT to any thread (torch's
    worker threads exist once the model ran), and then a main thread blocked reading stdin never wakes
    to raise KeyboardInterrupt. Waiting in short selects lets it check for signals every 0.2 s."""
    sys.stdout.write(text)
    sys.stdout.flush()
    while not select.select([sys.stdin], [], [], 0.2)[0]:
        pass
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line


TemperatureOpt = Annotated[float, typer.Option(help="0 is greedy; higher samples more freely.")]
RepetitionOpt = Annotated[float, typer.Option(help="Above 1.0, penalizes tokens the answer already used (1.0 is off).")]
NoRepeatOpt = Annotated[int | None, typer.Option(help="No n-gram of this many tokens is generated twice, which stops a verbatim loop (0 is off; the "
                                                      f"same default as Corpus.ask and the adapters) [default: {SHOWN_NO_REPEAT_NGRAM}].", show_default=False)]
RecoveryOpt = Annotated[str | None, typer.Option(help="Cross-module attention recovery: none, last:N, attend:N, question:R, first_k:K or selective:R (default: the corpus's, set by eval --apply, else the one its tuned adapter was tuned for, else the engine's, last:3; docs/FIDELITY.md).")]
StopOpt = Annotated[list[str] | None, typer.Option("--stop", help="Stop the answer at this string (repeatable).")]
MinScoreOpt = Annotated[float | None, typer.Option("--min-score", help="Answer \"Not found in the documents.\" without generating when no chunk scores at least this (cosine similarity, -1 to 1; `ask --json` shows the scores) [default: off].", show_default=False)]


def _sampling(temperature: float, repetition_penalty: float, no_repeat_ngram: int | None, recovery: str | None,
              stop: list[str] | None) -> dict[str, object]:
    """Options given → Corpus.ask keyword arguments; one not given is left to Corpus.ask's default."""
    out: dict[str, object] = {"temperature": temperature, "repetition_penalty": repetition_penalty,
                              "no_repeat_ngram": no_repeat_ngram, "recovery": recovery, "stop": tuple(stop or ())}
    return {k: v for k, v in out.items() if v is not None}


@app.command()
@handle_errors
def ask(
    question: Annotated[str, typer.Argument(help="The question.")],
    corpus: CorpusOpt,
    k: KOpt = 4,
    stream: Annotated[bool, typer.Option("--stream", help="Print the answer as it is generated (with --json: JSON lines).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (with --stream: one line per piece, then the answer).")] = False,
    max_new_tokens: MaxNewOpt = 256,
    redis_url: RedisOpt = None,
    temperature: TemperatureOpt = 0.0,
    repetition_penalty: RepetitionOpt = 1.0,
    no_repeat_ngram: NoRepeatOpt = None,
    recovery: RecoveryOpt = None,
    stop: StopOpt = None,
    dtype: DtypeOpt = None,
    adapter: AdapterOpt = "default",
    min_score: MinScoreOpt = None,
) -> None:
    """Answer a question from the corpus."""
    _check_k(k)
    if not question.strip():
        raise fail("the question is empty")
    sampling = _sampling(temperature, repetition_penalty, no_repeat_ngram, recovery, stop)
    c = _open(corpus, redis_url, dtype, adapter)
    _check_nonempty(c)
    sampling["min_score"] = min_score
    if stream:
        s = c.ask_stream(question, k, max_new_tokens=max_new_tokens, **sampling)
        for piece in s:
            typer.echo(json.dumps({"delta": piece}) if as_json else piece, nl=as_json)
        if not as_json:
            typer.echo()
        answer = s.answer
    else:
        answer = c.ask(question, k, max_new_tokens=max_new_tokens, **sampling)
    if as_json:
        typer.echo(json.dumps(answer.to_dict()))
    else:
        if not stream:
            typer.echo(answer.answer)
        if cut := cut_off(answer.finish_reason, max_new_tokens):
            typer.echo(cut)
        typer.echo(f"\nsources: {', '.join(dict.fromkeys(answer.sources)) or 'none (nothing scored --min-score)'}")
        typer.echo(_stats(answer))
    c.close()


def _stats(answer) -> str:
    missed = f", {len(answer.missed_modules)} module(s) recomputed" if answer.missed_modules else ""
    return (f"ttft {answer.ttft_s:.2f}s ({answer.path} path), {answer.cached_tokens} cached / {answer.computed_tokens} "
            f"computed tokens{missed}")


@app.command()
@handle_errors
def chat(
    corpus: CorpusOpt,
    k: KOpt = 4,
    max_new_tokens: MaxNewOpt = 256,
    turns: Annotated[int, typer.Option(help="Earlier turns kept as context.")] = 3,
    temperature: TemperatureOpt = 0.0,
    repetition_penalty: RepetitionOpt = 1.0,
    no_repeat_ngram: NoRepeatOpt = None,
    recovery: RecoveryOpt = None,
    stop: StopOpt = None,
    redis_url: RedisOpt = None,
    dtype: DtypeOpt = None,
    adapter: AdapterOpt = "default",
    min_score: MinScoreOpt = None,
) -> None:
    """Chat with the corpus: streaming answers, history, /sources, /quit. Ctrl-C stops an answer."""
    _check_k(k)
    sampling = {**_sampling(temperature, repetition_penalty, no_repeat_ngram, recovery, stop), "min_score": min_score}
    c = _open(corpus, redis_url, dtype, adapter)
    _check_nonempty(c)
    typer.echo(f"loading the model and the embedder for {corpus} ...", err=True)
    c.prepare()  # now, so that no loading output lands inside the first answer
    c.embedder  # noqa: B018 - loads it
    typer.echo(f"chatting with {corpus} ({len(c)} modules); /sources shows where the last answer came from, "
               "/quit (or Ctrl-D) ends, Ctrl-C stops an answer")
    history: list[tuple[str, str]] = []
    # What /sources shows: the last answer's (module id, source, score), a stopped answer's too; None
    # before any question, [] when a question was stopped before retrieval found anything.
    shown: list[tuple[str, str, float]] | None = None
    while True:
        try:
            line = _prompt("you> ").strip()
        except EOFError:
            break
        except KeyboardInterrupt:
            typer.echo("\n(to quit, type /quit or press Ctrl-D)")
            continue
        if not line:
            continue
        if line in ("/quit", "/exit", "/q"):
            break
        if line == "/sources":
            if shown is None:
                typer.echo("no answer yet")
            elif not shown:
                typer.echo("the last question was stopped before its sources were retrieved")
            for mid, src, score in shown or ():
                typer.echo(f"  {src}  ({mid}, score {score:.3f})")
            continue
        if line.startswith("/"):
            typer.echo("commands: /sources, /quit")
            continue
        s = None
        try:
            s = c.ask_stream(line, k, history=history[-turns:] if turns else (), max_new_tokens=max_new_tokens, **sampling)
            typer.echo("bot> ", nl=False)
            for piece in s:
                typer.echo(piece, nl=False)
        except KeyboardInterrupt:
            if s is not None:
                s.close()
            # the stopped answer is not history, but what it was drawn from is what /sources asks
            shown = [] if s is None else [(m, src, score) for (m, score), src in zip(s.hits, s.sources)]
            typer.echo("\n  [stopped; the chat goes on]")
            continue
        except ValueError as e:  # this question cannot be answered (too long, say): the chat goes on
            typer.echo(f"\nerror: {e}", err=True)
            continue
        last = s.answer
        shown = list(zip(last.module_ids, last.sources, last.scores))
        if cut := cut_off(last.finish_reason, max_new_tokens):
            typer.echo(f"\n  {cut}", nl=False)
        typer.echo(f"\n  [{_stats(last)}]")
        history.append((line, last.answer))
    c.close()


@app.command()
@handle_errors
def info(
    corpus: CorpusOpt,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    documents: Annotated[bool, typer.Option("--documents", help=f"List every document, not only the first {SHOWN_DOCUMENTS}.")] = False,
) -> None:
    """Documents, modules, tokens, store size and model of a corpus, and its documents."""
    from rag_promptcache.cli.output import echo_facts, echo_table, mib

    c = _open(corpus)
    from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY
    from rag_promptcache.rag.models import tuned_recovery

    # the schema's name is what a hand-written PML prompt imports the corpus's modules under
    # (`<prompt schema="…">`, e.g. in /v1/completions)
    facts = {**c.info(), "schema": c.manifest.name, "documents": c.documents()}
    try:
        tuned = tuned_recovery(c.adapter_path)
    except ValueError as e:  # the adapter it was encoded with is not here: info still shows the rest
        tuned, facts["adapter_missing"] = None, str(e)
    c.close()
    incomplete = f" ({facts['num_incomplete']} incomplete: run ingest again)" if facts["num_incomplete"] else ""
    echo_facts(facts, [
        ("corpus", str(facts["path"])),
        ("documents", f"{facts['num_documents']}{incomplete}"),
        ("modules", f"{facts['num_modules']} ({facts['num_tokens']} tokens; {facts['num_chunks']} chunks)"),
        ("store", f"{mib(facts['store_bytes'])}, codec {facts['codec']}"),
        ("schema", f"{facts['schema']} (PML prompts import its modules: <prompt schema=\"{facts['schema']}\">)"),
        ("model", f"{facts['model']} (fingerprint {facts['fingerprint']}, mode {facts['mode']}, {facts['dtype']})"),
        ("adapter", _adapter_line(facts)),
        ("recovery", f"{facts['recovery']} (set by eval --apply)" if facts["recovery"]
         else f"{tuned} (the adapter's; `eval --apply` sets one for this corpus)" if tuned
         else f"{DEFAULT_RECOVERY} (the engine default; `eval --apply` sets one for this corpus)"),
        ("embedder", f"{facts['embedder']} (dim {facts['dim']}), index {facts['index']}"),
        ("chunking", f"{facts['chunk_tokens']} tokens, overlap {facts['overlap']}, max {facts['max_tokens']}"),
        ("instructions", " ".join(facts["instructions"].split())),
    ], as_json)
    if as_json:
        return
    docs = facts["documents"]
    shown = docs if documents else docs[:SHOWN_DOCUMENTS]
    typer.echo()
    echo_table(("document", "chunks", "bytes", "status"),
               [(d["name"], d["num_chunks"], d["num_bytes"], "ok" if d["complete"] else "incomplete") for d in shown])
    if len(shown) < len(docs):
        typer.echo(f"... and {len(docs) - len(shown)} more (--documents lists all)")


def _adapter_line(facts: dict) -> str:
    if facts["adapter_digest"]:
        where = "NOT AVAILABLE here" if "adapter_missing" in facts else "merged into the model's weights"
        return f"{facts['adapter']} (digest {facts['adapter_digest']}, {where})"
    if facts["adapter"] is None:
        return "none (the base model; encoded before tuned adapters shipped)"
    return "none (the base model)"


@app.command()
@handle_errors
def remove(sources: Annotated[list[str], typer.Argument(help="Documents to forget: paths, ids, or the names `ask` prints in its sources and `info` lists.")], corpus: CorpusOpt) -> None:
    """Remove documents, their modules and their vectors from a corpus."""
    c = _open(corpus)
    for source in sources:
        typer.echo(f"removed {source}: {c.remove(source)} module(s)")
    c.close()
