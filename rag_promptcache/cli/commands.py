"""The corpus commands: ingest, ask, chat, info, remove. Parsing and printing only; the work is in
`rag_promptcache.rag.Corpus`."""

from __future__ import annotations

import json
import select
import sys
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import SHOWN_DTYPES, TOO_LONG, AdapterOpt, DtypeOpt, RedisOpt, app, check_name, fail, handle_errors
from rag_promptcache.cli.ingest_cmd import CorpusOpt, KOpt, encoded_line, quiet_ray  # noqa: F401 - re-exported
from rag_promptcache.cli.output import cut_off, empty_answer, source_lines

# Help shows the corpus default (rag_promptcache.rag.repetition.DEFAULT_NO_REPEAT_NGRAM; a test holds
# them equal) without importing rag, whose package imports torch: `--help` stays fast.
SHOWN_NO_REPEAT_NGRAM = 6
SHOWN_MAX_NEW_TOKENS = 256  # rag.repetition.ANSWER_DEFAULTS.max_new_tokens, held equal the same way

SHOWN_DOCUMENTS = 20
MaxNewOpt = Annotated[int, typer.Option("--max-new-tokens", help="Longest answer, in tokens.")]


def _open(corpus: Path, redis_url: str | None = None, dtype: str | None = None, adapter: str = "default",
          read_only: bool = False):
    from rag_promptcache.rag.layout import check_corpus

    check_name("dtype", dtype, SHOWN_DTYPES)
    check_corpus(corpus)  # a wrong path or name fails before torch is imported (seconds)
    from rag_promptcache.rag import Corpus

    return Corpus.open(corpus, redis_url=redis_url, dtype=dtype, adapter=adapter, read_only=read_only)


def _check_k(k: int) -> None:
    if k < 1:
        raise fail(f"-k must be at least 1, got {k}")


def _check_nonempty(c) -> None:
    if not len(c):
        raise fail(f"corpus {c.path} is empty; add documents with: rag-promptcache ingest PATH --corpus {c.path}")


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
RecoveryOpt = Annotated[str | None, typer.Option(help="Cross-module attention recovery: none, last:N, tail:T, attend:N, question:R, first_k:K or selective:R, any but none followed by @k>=N to recover only in prompts of N modules or more (default: the corpus's, set by eval --apply, else the one its tuned adapter was tuned for, else the engine's, last:3; docs/FIDELITY.md).")]
StopOpt = Annotated[list[str] | None, typer.Option("--stop", help="Stop the answer at this string (repeatable).")]
WhereOpt = Annotated[list[str] | None, typer.Option("--where", help="Only chunks whose metadata matches: KEY=VALUE (repeatable: all must hold; a key repeated with = means one of its values), KEY!=VALUE, KEY>VALUE, KEY>=VALUE, KEY<VALUE, KEY<=VALUE, KEY~GLOB, or a JSON filter. Keys: source, path, type, title, modified, section and the documents' own fields (docs/retrieval.md).", show_default=False)]
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
    max_new_tokens: MaxNewOpt = SHOWN_MAX_NEW_TOKENS,
    redis_url: RedisOpt = None,
    temperature: TemperatureOpt = 0.0,
    repetition_penalty: RepetitionOpt = 1.0,
    no_repeat_ngram: NoRepeatOpt = None,
    recovery: RecoveryOpt = None,
    stop: StopOpt = None,
    dtype: DtypeOpt = None,
    adapter: AdapterOpt = "default",
    min_score: MinScoreOpt = None,
    where: WhereOpt = None,
) -> None:
    """Answer a question from the corpus; each source is shown as file › section with a snippet. A
    question too long for the model's context window is refused with exit code 2. Each call loads the
    model, the embedder and the indexes before its first token (seconds); for many questions prefer `chat`
    (one load, then a conversation) or `serve` (one load, then an OpenAI-compatible server), where each
    answer costs only its own time."""
    _check_k(k)
    if not question.strip():
        raise fail("the question is empty")
    sampling = {**_sampling(temperature, repetition_penalty, no_repeat_ngram, recovery, stop), "filter": _where(where)}
    c = _open(corpus, redis_url, dtype, adapter)
    _check_nonempty(c)
    c.prepare(pack=False)  # one answer: packing the weights would cost more than it saves (engine/compute/forward.py)
    sampling["min_score"] = min_score
    from rag_promptcache.engine.errors import ContextWindowExceeded

    try:
        if stream:
            s = c.ask_stream(question, k, max_new_tokens=max_new_tokens, **sampling)
            for piece in s:
                typer.echo(json.dumps({"delta": piece}) if as_json else piece, nl=as_json)
            if not as_json:
                typer.echo()
            answer = s.answer
        else:
            answer = c.ask(question, k, max_new_tokens=max_new_tokens, **sampling)
    except ContextWindowExceeded as e:  # a question the window cannot take is refused, never answered with nothing
        raise fail(str(e).replace("max_new_tokens", "--max-new-tokens"), TOO_LONG, "context_length_exceeded") from None
    if as_json:
        typer.echo(json.dumps(answer.to_dict()))
    else:
        if not stream:
            typer.echo(answer.answer)
        if note := cut_off(answer.finish_reason, max_new_tokens) or empty_answer(answer.answer, answer.finish_reason):
            typer.echo(note)
        typer.echo("\nsources:" + ("" if answer.module_ids else " none (nothing scored --min-score or matched --where)"))
        for line in source_lines(_rows(answer)):
            typer.echo(line)
        typer.echo(_stats(answer))
    _store_deferred(c, answer, quiet=as_json)
    c.close()


def _store_deferred(c, answer, quiet: bool) -> None:
    """The modules this answer computed without waiting for their encoding, and the entries after their
    neighbours it read plain in their place (`--neighbours-present`), stored before the process ends
    (Ctrl-C skips it: the store keeps what was written whole, and they are misses next time)."""
    queued = c.engine.background.stats().num_queued if c.loaded else 0
    if not answer.deferred_modules and not queued:
        return
    if not quiet:
        typer.echo(f"storing {max(queued, len(answer.deferred_modules))} module(s) for later questions (Ctrl-C skips)",
                   err=True)
    try:
        c.store_deferred()
    except KeyboardInterrupt:
        typer.echo("skipped: they are computed again when next retrieved", err=True)


def _rows(answer) -> list[tuple[str, float | None, str]]:
    """An `Answer`'s sources as `source_lines` takes them: (file › section, score, snippet)."""
    from rag_promptcache.rag.retrieval import where

    sections = answer.sections or ("",) * len(answer.sources)
    snippets = answer.snippets or ("",) * len(answer.sources)
    return [(where(src, sec), score, snip) for src, sec, score, snip in zip(answer.sources, sections, answer.scores, snippets)]


def _where(clauses: list[str] | None) -> object:
    """`--where` clauses as one filter (`rag.filters.where`); a malformed clause is a usage error."""
    from rag_promptcache.rag.filters import where

    try:
        return where(clauses or ())
    except ValueError as e:
        raise fail(str(e)) from e


def _stats(answer) -> str:
    if answer.deferred_modules:
        missed = f", {len(answer.deferred_modules)} missed module(s) computed here, stored after the answer"
    else:
        missed = f", {len(answer.missed_modules)} module(s) encoded first" if answer.missed_modules else ""
    return (f"ttft {answer.ttft_s:.2f}s ({answer.path} path), {answer.cached_tokens} cached / {answer.computed_tokens} "
            f"computed tokens{missed}")


@app.command()
@handle_errors
def chat(
    corpus: CorpusOpt,
    k: KOpt = 4,
    max_new_tokens: MaxNewOpt = SHOWN_MAX_NEW_TOKENS,
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
    where: WhereOpt = None,
) -> None:
    """Chat with the corpus: streaming answers, history, /sources, /quit. Ctrl-C stops an answer."""
    _check_k(k)
    sampling = {**_sampling(temperature, repetition_penalty, no_repeat_ngram, recovery, stop), "min_score": min_score,
                "filter": _where(where)}
    c = _open(corpus, redis_url, dtype, adapter)
    _check_nonempty(c)
    c.catalog.check(sampling["filter"])  # an unknown key ends the command now, not each question
    typer.echo(f"loading the model and the embedder for {corpus} ...", err=True)
    c.prepare()  # now, so that no loading output lands inside the first answer
    c.embedder  # noqa: B018 - loads it
    typer.echo(f"chatting with {corpus} ({len(c)} modules); /sources shows where the last answer came from, "
               "/quit (or Ctrl-D) ends, Ctrl-C stops an answer")
    history: list[tuple[str, str]] = []
    # What /sources shows: the last answer's (file › section, score, snippet), a stopped answer's too;
    # None before any question, [] when a question was stopped before retrieval found anything.
    shown: list[tuple[str, float | None, str]] | None = None
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
            for row in source_lines(shown or ()):
                typer.echo(row)
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
            shown = [] if s is None else [(h.where, h.score, h.snippet) for h in s.found]
            typer.echo("\n  [stopped; the chat goes on]")
            continue
        except ValueError as e:  # this question cannot be answered (too long, say): the chat goes on
            typer.echo(f"\nerror: {e}", err=True)
            continue
        last = s.answer
        shown = _rows(last)
        if note := cut_off(last.finish_reason, max_new_tokens) or empty_answer(last.answer, last.finish_reason):
            typer.echo(f"\n  {note}", nl=False)
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

    c = _open(corpus, read_only=True)  # what it shows, it reads: a repair is ingest's to write
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
    incomplete = (f" ({facts['num_incomplete']} incomplete: the last ingest was interrupted; run ingest again to resume)"
                  if facts["num_incomplete"] else "")
    echo_facts(facts, [
        ("corpus", str(facts["path"])),
        ("documents", f"{facts['num_documents']}{incomplete}"),
        ("modules", f"{facts['num_modules']} ({facts['num_tokens']} tokens; {facts['num_chunks']} chunks)"),
        ("store", f"{mib(facts['store_bytes'])} on disk, codec {facts['codec']}"),
        ("kv", f"{facts['kv']}: {encoded_line(facts['encoded'])}"
               + (f"; each module encoded after its {facts['neighbours']} nearest" if facts.get("neighbours") else "")
               + (f", read so where {facts['neighbours_present']} of them are retrieved with it (its plain KV otherwise)"
                  if facts.get("neighbours_present") else "")
               + ("; each module kept from the prefill of the first question to retrieve it" if facts.get("byproduct") else "")),
        ("budget", _budget_line(facts["budget"])),
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


def _budget_line(b: dict) -> str:
    from rag_promptcache.rag.budget import StoreBudget

    return StoreBudget(**b).describe() + " (ingest --store-budget, --eviction)"


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
