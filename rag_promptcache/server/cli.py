"""`rag-promptcache serve`: plugged into the CLI through `register(app)`, the hook cli/app.py looks for."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import AdapterOpt, DtypeOpt, RedisOpt


def register(app: typer.Typer) -> None:
    from rag_promptcache.cli.app import handle_errors

    @app.command()
    @handle_errors
    def serve(
        corpus: Annotated[list[Path], typer.Option(
            "--corpus", "-c", file_okay=False,
            help="A corpus directory to answer from, or a folder of them; repeat it to serve several: a request's "
                 "`model` names the corpus (its directory's name), and corpora built with one model share it.")],
        host: Annotated[str, typer.Option("--host", help="Interface to listen on (no TLS: keep it on loopback or behind a proxy).")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", help="Port to listen on (0: any free one).")] = 8000,
        k: Annotated[int, typer.Option("-k", "--k", help="How many chunks to retrieve per question (a request's `k` overrides it).")] = 4,
        max_batch: Annotated[int, typer.Option("--max-batch", help="Requests decoded together.")] = 8,
        max_queue: Annotated[int, typer.Option("--max-queue", help="Requests waiting for a row; past it, 429 with Retry-After.")] = 64,
        prefill_chunk: Annotated[int | None, typer.Option(
            "--prefill-chunk", envvar="RAG_PROMPTCACHE_PREFILL_CHUNK", show_envvar=True,
            help="Run a new request's prefill N tokens at a time with the running requests' decode steps: bounds how "
                 "long their streams stall, at some cost to throughput on a CPU [default: whole prefills].")] = None,
        admission: Annotated[str, typer.Option(
            "--admission", envvar="RAG_PROMPTCACHE_ADMISSION", show_envvar=True,
            help="How whole prefills join the running requests: 'all' admits every waiting one in one step (best "
                 "throughput), 'one' runs one prefill between decode steps (streams stall about 0.6 s instead of "
                 "3 s at 8 clients, at a later first token under load). Not with --prefill-chunk.")] = "all",
        redis_url: RedisOpt = None,
        dtype: DtypeOpt = None,
        adapter: AdapterOpt = "default",
        api_key: Annotated[str | None, typer.Option(
            "--api-key", envvar="RAG_PROMPTCACHE_API_KEY", show_envvar=True,
            help="Require 'Authorization: Bearer KEY' on every route but /health (the chat page asks for it).")] = None,
        shutdown_timeout: Annotated[float, typer.Option(
            "--shutdown-timeout", help="On SIGTERM or Ctrl-C, seconds open requests get to finish before they are cancelled.")] = 30,
        min_score: Annotated[float | None, typer.Option(
            "--min-score", show_default=False,
            help="Answer \"Not found in the documents.\" without generating when no chunk scores at least this "
                 "(cosine similarity, -1 to 1; a request's `min_score` overrides it) [default: off].")] = None,
        log_level: Annotated[str, typer.Option("--log-level", help="debug, info (one access line per request), warning or error.")] = "info",
        log_format: Annotated[str, typer.Option("--log-format", help="text, or json (one object per line).")] = "text",
        ray: Annotated[bool, typer.Option("--ray", help="Serve as a Ray Serve deployment of --replicas replicas over the shared Redis tier.")] = False,
        replicas: Annotated[int | None, typer.Option("--replicas", show_default=False, help="With --ray: replicas, each with its own engine [default: 2].")] = None,
        autoscale: Annotated[str | None, typer.Option(
            "--autoscale", metavar="MIN:MAX",
            help="With --ray, instead of --replicas: let Ray Serve's autoscaler keep MIN to MAX replicas, aiming at "
                 "--max-batch requests in flight per replica.")] = None,
        ray_address: Annotated[str | None, typer.Option(
            "--ray-address", help="With --ray: join this cluster (HOST:PORT, ray://HOST:PORT or auto) [default: start a local one].")] = None,
    ) -> None:
        """Serve corpora over the OpenAI API (chat, completions, embeddings, streaming) and a chat page at /, batching concurrent requests."""
        for name, value, low, high in [("--port", port, 0, 65535), ("-k", k, 1, None), ("--max-batch", max_batch, 1, None),
                                       ("--max-queue", max_queue, 0, None), ("--prefill-chunk", prefill_chunk, 1, None),
                                       ("--shutdown-timeout", shutdown_timeout, 0, None), ("--min-score", min_score, -1, 1),
                                       ("--replicas", replicas, 1, None)]:
            if value is not None and (value < low or (high is not None and value > high)):
                raise ValueError(f"{name} must be at least {low}" + (f" and at most {high}" if high is not None else "")
                                 + f", got {value:g}")
        from rag_promptcache.cli.app import SHOWN_DTYPES, check_name
        from rag_promptcache.rag.layout import find_corpora

        check_name("dtype", dtype, SHOWN_DTYPES)
        # a wrong path, name or combination fails before torch and the server stack are imported (seconds)
        corpora = find_corpora(corpus)
        if api_key is not None and not api_key.strip():
            raise ValueError("--api-key is empty; pass a key or leave it unset")
        if not ray and (replicas is not None or autoscale is not None or ray_address is not None):
            raise ValueError("--replicas, --autoscale and --ray-address need --ray")
        if replicas is not None and autoscale is not None:
            raise ValueError("--replicas and --autoscale exclude each other: a fixed count, or a range")
        from rag_promptcache.server.ray_serve import ReplicaOptions, parse_autoscale, serve_ray  # no Ray until it serves

        bounds = parse_autoscale(autoscale) if autoscale is not None else None
        from rag_promptcache.engine.batching.batcher import ADMISSIONS
        from rag_promptcache.server import serve as run
        from rag_promptcache.server.access_log import FORMATS, LEVELS

        if admission not in ADMISSIONS:
            raise ValueError(f"--admission {admission!r}: valid: {', '.join(ADMISSIONS)}")
        if admission == "one" and prefill_chunk is not None:
            raise ValueError("--admission one admits whole prefills: it excludes --prefill-chunk")
        if log_level not in LEVELS:
            raise ValueError(f"--log-level {log_level!r}: valid: {', '.join(LEVELS)}")
        if log_format not in FORMATS:
            raise ValueError(f"--log-format {log_format!r}: valid: {', '.join(FORMATS)}")
        if ray:
            opts = ReplicaOptions(tuple(str(c.resolve()) for c in corpora), k=k, max_batch=max_batch, max_queue=max_queue,
                                  redis_url=redis_url, dtype=dtype, api_key=api_key, prefill_chunk=prefill_chunk,
                                  admission=admission, min_score=min_score, adapter=adapter)
            serve_ray(corpora, replicas=2 if replicas is None else replicas, autoscale=bounds, ray_address=ray_address,
                      host=host, port=port, opts=opts, log=typer.echo)
            return
        run(corpora, host=host, port=port, k=k, max_batch=max_batch, max_queue=max_queue, redis_url=redis_url, dtype=dtype,
            api_key=api_key, prefill_chunk=prefill_chunk, admission=admission, shutdown_timeout=shutdown_timeout, min_score=min_score,
            log_level=log_level, log_format=log_format, adapter=adapter, log=typer.echo)
