"""`rag-promptcache ingest` and `warm`: building a corpus, updating it, and encoding its most retrieved
modules ahead of questions. Parsing and printing only; the work is `Corpus.build` / `add` / `warm`."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import SHOWN_CODECS, SHOWN_DTYPES, AdapterOpt, DtypeOpt, RedisOpt, app, check_name, fail, handle_errors
from rag_promptcache.rag.loaders import SUFFIXES  # torch-free: --help lists what the loaders take

# The corpus options every corpus command shares (commands.py imports them from here, so `ingest` is
# registered first and leads `--help`).
CorpusOpt = Annotated[Path, typer.Option("--corpus", "-c", help="The corpus directory.", file_okay=False)]
KOpt = Annotated[int, typer.Option("-k", "--k", help="How many chunks to retrieve.")]

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
    codec: Annotated[str | None, typer.Option(help=f"How a new corpus stores module KV in memory, on disk and in Redis: {', '.join(SHOWN_CODECS)} [default: k6v6]; `eval --codec` measures what one does to answers (docs/stores.md).", show_default=False)] = None,
    kv: Annotated[str | None, typer.Option("--kv", help="When module KV is computed: eager (now, every chunk) or lazy (when a question first retrieves a chunk; ingest only chunks, embeds and indexes, and the store starts empty) [default: the corpus's, eager for a new one]; docs/stores.md says which to choose.", show_default=False)] = None,
    store_budget: Annotated[str | None, typer.Option("--store-budget", help="The store's bytes per tier, recorded in the corpus and held by every process that opens it: memory=1GiB,disk=20GiB,redis=4GiB (none: unbounded; a tier not named keeps its budget) [default: memory 1 GiB per process, disk and Redis unbounded].", show_default=False)] = None,
    eviction: Annotated[str | None, typer.Option(help="Which entries a full tier drops first: lru or cost (greedy-dual-size-frequency: recompute cost per byte and hits) [default: the corpus's, cost for a new one].", show_default=False)] = None,
    neighbours: Annotated[int | None, typer.Option("--neighbours", help="Encode each module after the M modules nearest its text (their KV dropped, its own kept), so that it has read what a question likely retrieves beside it: more answers kept at no cost per question, but ingest encodes (M+1)x the tokens. 0: off. Set once for a corpus [default: the corpus's, 0 for a new one]; docs/concepts.md.", metavar="M", show_default=False)] = None,
    neighbours_present: Annotated[int | None, typer.Option("--neighbours-present", help="With --neighbours M: also store each module's plain KV (encoded without its neighbours), and read the KV encoded after them only where at least C of its M neighbours are retrieved into the same prompt, the plain KV otherwise; with recovery none, C = 2 of M = 3 kept 89-95% of the answers on look-alike records at 8-43x and 80-88% on manual pages (docs/FIDELITY.md). Ingest encodes each module's plain KV only (what an ingest without neighbours encodes), so the corpus answers from it at once; the KV encoded after the neighbours ((M+1)x the tokens) follows in idle time: a server encodes it while no request runs, a question that read a module plain queues it, `warm --all` encodes it now. 0: always read the KV encoded after them. Set once for a corpus [default: the corpus's, 0 for a new one].", metavar="C", show_default=False)] = None,
    byproduct: Annotated[bool | None, typer.Option("--byproduct/--no-byproduct", help="With --kv lazy: keep a missed module's KV from the prefill of the question that first retrieves it (computed after the modules retrieved with it) instead of encoding it on its own: storing it runs no model at all. On look-alike documents its answers held with nothing recomputed where plain modules' did not; on unrelated pages (a manual) it lost some: run `eval` on your questions before choosing it. Set once for a corpus; not with --neighbours [default: the corpus's, off for a new one]; docs/stores.md.", show_default=False)] = None,
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

    from rag_promptcache.rag.neighbours import check as check_neighbours

    ray_opts = None
    if ray:
        from rag_promptcache.rag.distributed import RayOptions

        ray_opts = RayOptions(address=ray_address, workers=workers, cpus_per_worker=cpus_per_worker, kv=ray_kv)
    elif ray_address is not None:
        raise fail("--ray-address needs --ray")
    check_neighbours(neighbours, neighbours_present)  # refused before anything loads
    if not is_corpus(corpus):  # a new corpus's choice, refused before any model loads
        from rag_promptcache.rag.budget import check_byproduct

        check_byproduct(byproduct, kv, neighbours)
    if ray:
        quiet_ray(ray_address)
    parse_dtype(dtype)  # a bad name fails before anything is created
    if codec is not None:
        from rag_promptcache.store.codecs import check_codec

        check_codec(codec)
    instructions = _read_instructions(instructions)
    existed = is_corpus(corpus)
    budget = _budget(corpus, existed, store_budget, eviction, kv)
    try:
        c, report = _ingest(paths, corpus, existed, model, chunk_tokens, overlap, embedder, index, field, id_field,
                            max_ingest_tokens, redis_url, ray_opts, dtype, adapter, instructions, codec, kv, budget, neighbours,
                            byproduct, neighbours_present)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted; committed work is kept, run the same command again to resume", err=True)
        raise typer.Exit(130) from None
    from rag_promptcache.cli.output import mib

    info = c.info()
    if report is not None:
        typer.echo(report.summary())
    typer.echo(f"{'updated' if existed else 'created'} corpus {corpus}: {info['num_documents']} documents, "
               f"{info['num_modules']} modules, {info['num_tokens']} tokens; store {mib(info['store_bytes'])} "
               f"({info['codec']}); kv {info['kv']}: {encoded_line(info['encoded'])}")
    c.close()
    if report is not None and report.failed:
        raise fail(f"{len(report.failed)} file(s) failed and are kept incomplete; run the same command again to retry them")



def _print_estimate(estimate) -> None:
    """Before a large ingest (`rag.ingest.LARGE_INGEST_TOKENS`): its expected store size in each codec,
    the corpus's marked, eager (all of it now) and lazy (none now, what questions retrieve later)."""
    from rag_promptcache.cli.output import mib

    sizes = ", ".join(f"{c} {mib(b)}{' (this corpus)' if c == estimate.codec else ''}"
                      for c, b in estimate.bytes_per_codec)
    from rag_promptcache.rag.progress import duration

    typer.echo(f"about {estimate.num_tokens:,} new tokens; expected store growth per codec: {sizes}", err=True)
    now = "this ingest" if estimate.kv == "eager" else "--kv eager"
    later = "this ingest" if estimate.kv == "lazy" else "--kv lazy"
    took = "" if estimate.seconds is None else f", about {duration(estimate.seconds)} of encoding on this machine"
    what = "the plain entries (half) now, the rest in idle time" if estimate.both else "all of it now"
    typer.echo(f"  eager ({now}): {what}{took}; lazy ({later}): 0 B now (chunking and embedding only), "
               f"then the chunks questions retrieve, up to the store budget ({estimate.budget})", err=True)
    if estimate.kv == "eager" and estimate.room is not None and estimate.bytes() > estimate.room:
        typer.echo(f"warning: the store budget holds {mib(estimate.room)}, less than this ingest's "
                   f"{mib(estimate.bytes())}: eager encoding would evict most of it as it is written; "
                   "ingest with --kv lazy to encode what questions retrieve", err=True)


def encoded_line(cov: dict) -> str:
    """`info`'s coverage: how much of the corpus's KV the store holds."""
    share = cov["num_encoded_tokens"] / cov["num_tokens"] if cov["num_tokens"] else 0.0
    after = cov.get("num_after_neighbours")
    return (f"{cov['num_encoded']} of {cov['num_modules']} modules encoded, {share:.0%} of their tokens"
            + (f"; {after} also after their neighbours (the rest read plain until a question that reads them, "
               "idle time or `warm --all` encodes them)" if after is not None else ""))


def _budget(corpus: Path, existed: bool, spec: str | None, eviction: str | None, kv: str | None):
    """The store budget `--store-budget`/`--eviction` ask for, over the corpus's own (None: not asked);
    bad values fail before anything loads."""
    from rag_promptcache.rag import budget as budgeting
    from rag_promptcache.rag.lazy import check_kv

    check_kv(kv)
    if spec is None and eviction is None:
        return None
    base = None
    if existed:
        from rag_promptcache.rag.layout import read_manifest

        base = budgeting.StoreBudget.of(read_manifest(corpus))
    return budgeting.parse(spec or "", base, eviction)


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
            redis_url, ray_opts, dtype, adapter, instructions, codec, kv, budget, neighbours, byproduct, neighbours_present):
    from rag_promptcache.rag import Corpus, LoaderWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", LoaderWarning)
        warnings.showwarning = lambda message, *a, **k: typer.echo(f"warning: {message}", err=True)
        if existed:
            c = Corpus.open(corpus, model=model, embedder=embedder, redis_url=redis_url, dtype=dtype, adapter=adapter)
            asked = {"chunk_tokens": chunk_tokens, "overlap": overlap, "index": index, "neighbours": neighbours,
                     "byproduct": byproduct, "neighbours_present": neighbours_present}
            for key, value in asked.items():
                if value is not None and value != getattr(c.manifest, key):
                    raise fail(f"corpus {corpus} uses {key}={getattr(c.manifest, key)!r}, not {value!r}; ingest into a new corpus to change it")
            if codec is not None and codec != c.manifest.codec:
                raise fail(f"corpus {corpus} stores KV as {c.manifest.codec}, not {codec}; ingest into a new corpus "
                           "with --codec to change it")
            if instructions is not None and instructions != c.manifest.instructions:
                raise fail(f"corpus {corpus} has other instructions (`info` shows them); every module is encoded after "
                           "them, so changing them means encoding every module again: ingest into a new corpus with "
                           "--instructions")
            for change in c.set_budget(budget, kv=kv):
                typer.echo(f"changed: {change}" + (" (entries over a lowered budget are evicted as the store opens, "
                                                  "lowest priority first)" if "->" in change and "kv" not in change else ""), err=True)
            report = c.add(paths, field=field, id_field=id_field, token_budget=max_ingest_tokens, ray=ray_opts,
                           on_estimate=_print_estimate)
        else:
            c = Corpus.build(paths, corpus, model=model, embedder=embedder, chunk_tokens=chunk_tokens, overlap=overlap,
                             index=index, field=field, id_field=id_field, token_budget=max_ingest_tokens,
                             redis_url=redis_url, ray=ray_opts, dtype=dtype, adapter=adapter,
                             instructions=instructions, codec=codec, on_estimate=_print_estimate, kv=kv, budget=budget,
                             neighbours=neighbours, byproduct=byproduct, neighbours_present=neighbours_present)
            report = c.last_report
    return c, report




@app.command()
@handle_errors
def warm(
    corpus: CorpusOpt,
    top: Annotated[int, typer.Option("--top", help="How many of the most retrieved modules to encode.")] = 100,
    everything: Annotated[bool, typer.Option("--all", help="Every module instead of the --top N (the most retrieved first): a lazy corpus whole, or the KV encoded after their neighbours of a corpus ingested with --neighbours-present, which ingest leaves to idle time.")] = False,
    questions: Annotated[Path | None, typer.Option("--questions", help="A question log (one question a line, or JSON lines with a \"question\" field) whose retrievals rank the modules [default: what questions asked of this corpus have retrieved].", dir_okay=False, show_default=False)] = None,
    k: KOpt = 4,
    redis_url: RedisOpt = None,
) -> None:
    """Encode, ahead of questions, the module KV of the --top N modules questions retrieve most (a lazy
    corpus's, or an eager one's after its store evicted them), or of --all, skipping those stored already,
    within the store budget. Interrupted? Run it again to resume."""
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.lazy import read_questions

    if k < 1:
        raise fail(f"-k must be at least 1, got {k}")
    asked = read_questions(questions) if questions is not None else None
    c = Corpus.open(corpus, redis_url=redis_url)
    try:
        report = c.warm(None if everything else top, asked, k)
    except KeyboardInterrupt:
        typer.echo("\ninterrupted; what was encoded is stored, run the same command again to resume", err=True)
        raise typer.Exit(130) from None
    finally:
        cov = c.info()["encoded"]
        c.close()
    typer.echo(f"warmed {corpus}: {report.num_encoded} module(s) encoded ({report.num_tokens:,} tokens) in "
               f"{report.seconds:.1f}s, {report.num_held} of the {report.num_wanted} wanted already stored"
               + (f"; {report.capped}" if report.capped else ""))
    typer.echo(f"store: {encoded_line(cov)}")
