"""`rag-promptcache bench`: plugged into the CLI through `register(app)`, the hook cli/app.py looks for.

Heavy imports happen inside the command so `--help` stays fast. Not here: the scenarios.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from rag_promptcache.cli.app import AdapterOpt


def register(app: typer.Typer) -> None:
    from rag_promptcache.cli.app import handle_errors

    @app.command()
    @handle_errors
    def bench(
        quick: Annotated[bool, typer.Option("--quick", help="A shorter run: 512 and 2048 tokens, fewer questions and repeats (about 5 minutes on two CPU cores before the decode scenario grew; not re-timed).")] = False,
        json_out: Annotated[Path | None, typer.Option("--json", help="Write the JSON report here.")] = None,
        plots: Annotated[Path | None, typer.Option("--plots", help="Write bench.md and the PNG plots into this folder.")] = None,
        model: Annotated[str, typer.Option("--model", help="Model name, hub id, directory or .gguf.")] = "smollm2-135m-instruct",
        device: Annotated[str | None, typer.Option("--device", help="cpu, cuda, cuda:1 … [default: cuda if present, else cpu]")] = None,
        threads: Annotated[int | None, typer.Option("--threads", min=1, help="torch CPU threads [default: torch's].")] = None,
        recovery: Annotated[str | None, typer.Option("--recovery", help="Recovery for the TTFT, LangChain and serve runs, e.g. none or last:1@k>=5 [default: the engine's].")] = None,
        scenarios: Annotated[str | None, typer.Option("--scenarios", help="Comma-separated subset of: ttft, quality, memory, throughput, langchain, decode, fidelity (answers on confusable documents), ingest (local vs Ray), serve (concurrent HTTP clients), chat (6 turns over the same documents, against llama.cpp where llama-cpp-python is installed), sustained (300 novel questions against memory, disk and Redis tiers smaller than the corpus, with its checks), json (json_object answers under a 64-token budget); the last six only when named. The project's own harnesses (fuzz, soak, retrieval on real manuals, the large sustained run) run from a checkout: benchmarks/README.md.")] = None,
        contexts: Annotated[str | None, typer.Option("--contexts", help="Comma-separated retrieved-context sizes for TTFT, e.g. 2048,4096 [default: the run's].")] = None,
        decode_dtypes: Annotated[str | None, typer.Option("--decode-dtypes", help="Comma-separated dtypes the decode scenario runs each system in [default: float32,bfloat16].")] = None,
        decode_tokens: Annotated[int | None, typer.Option("--decode-tokens", min=2, help="New tokens per decode run [default: 128].")] = None,
        fidelity_settings: Annotated[str | None, typer.Option("--fidelity-settings", help="Comma-separated settings the fidelity scenario compares with full prefill, each RECOVERY or MODE/RECOVERY (mode: shared_prefix, the default, or isolated), e.g. none,last:2 [default: the sweep in bench/common.py].")] = None,
        fidelity_split: Annotated[str | None, typer.Option("--fidelity-split", help="bench, heldout (other templates and facts, the default chunk size), manuals (how-to procedures and parts tables), both (bench and heldout) or all: the fidelity scenario's documents [default: all].")] = None,
        dtype: Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16: the model's dtype in every scenario [default: auto, the device's default].")] = "auto",
        adapter: AdapterOpt = "default",
        llama_server: Annotated[Path | None, typer.Option("--llama-server", help="llama.cpp's llama-server binary: the serve scenario times it beside ours on the same token ids (built from the llama-cpp-python sdist; docs/serving.md) [default: that row is skipped].")] = None,
        serve_admission: Annotated[str, typer.Option("--serve-admission", help="How the serve scenario's batcher admits whole prefills: all (every waiting prefill before the next decode step) or one (one prefill between decode steps while rows run; waiting prefills in one batched forward when none runs). Run the scenario once per policy to compare them.")] = "all",
    ) -> None:
        """Measure TTFT, quality, memory and throughput against full prefill; write JSON, Markdown and plots."""
        import torch

        from rag_promptcache.bench import DEFAULT_SCENARIOS, HARNESSES, SCENARIOS, run
        from rag_promptcache.bench.common import BenchConfig
        from rag_promptcache.engine.planning.recovery import Recovery

        if threads is not None:
            torch.set_num_threads(threads)
        from rag_promptcache.model.loading import parse_dtype

        config = BenchConfig.quick() if quick else BenchConfig.full()
        parse_dtype(dtype)  # a bad name fails here, before the model loads
        from rag_promptcache.engine.batching.batcher import ADMISSIONS

        if serve_admission not in ADMISSIONS:
            raise ValueError(f"unknown --serve-admission {serve_admission!r}; valid: {', '.join(ADMISSIONS)}")
        config = dataclasses.replace(config, dtype=dtype, adapter=adapter, serve_admission=serve_admission,
                                     llama_server=str(llama_server) if llama_server is not None else None)
        if decode_dtypes is not None:
            names = tuple(d.strip() for d in decode_dtypes.split(",") if d.strip())
            for d in names:
                parse_dtype(d)
            config = dataclasses.replace(config, decode_dtypes=names)
        if decode_tokens is not None:
            config = dataclasses.replace(config, decode_tokens=decode_tokens)
        if contexts is not None:
            try:
                sizes = tuple(int(c) for c in contexts.split(","))
            except ValueError as e:
                raise ValueError(f"--contexts takes comma-separated token counts like 2048,4096, not {contexts!r}") from e
            if not sizes or min(sizes) < 1:
                raise ValueError(f"--contexts takes positive token counts, not {contexts!r}")
            config = dataclasses.replace(config, contexts=sizes)
        if recovery is not None:
            config = dataclasses.replace(config, recovery=str(Recovery.parse(recovery)))
        if fidelity_split is not None:
            from rag_promptcache.bench.fidelity import GROUPS, SPLITS

            splits = GROUPS.get(fidelity_split, (fidelity_split,))
            if not set(splits) <= set(SPLITS):
                raise ValueError(f"unknown --fidelity-split {fidelity_split!r}; valid: {', '.join((*SPLITS, *GROUPS))}")
            config = dataclasses.replace(config, fidelity_splits=splits)
        if fidelity_settings is not None:
            config = dataclasses.replace(config, fidelity_settings=_settings(fidelity_settings))
        chosen = tuple(s.strip() for s in scenarios.split(",")) if scenarios else DEFAULT_SCENARIOS
        if unknown := [s for s in chosen if s not in SCENARIOS]:  # before the model loads
            moved = [s for s in unknown if s in HARNESSES]
            raise ValueError(f"unknown --scenarios {', '.join(unknown)}; valid: {', '.join(SCENARIOS)}" + (
                f". {', '.join(moved)}: the project's own harnesses, run from a checkout: "
                f"{'; '.join(HARNESSES[s] for s in moved)} (benchmarks/README.md)" if moved else ""))
        run(quick=quick, json_path=json_out, plots_dir=plots, model=model, device=device, log=typer.echo,
            config=config, scenarios=chosen)


def _settings(text: str) -> tuple[tuple[str, str], ...]:
    """"none,isolated/last:2" → (("shared_prefix", "none"), ("isolated", "last:2")), each checked."""
    from rag_promptcache.engine.planning.encoder import check_mode
    from rag_promptcache.engine.planning.recovery import Recovery

    out = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        mode, _, rec = item.rpartition("/")
        out.append((check_mode(mode or "shared_prefix"), str(Recovery.parse(rec))))
    if not out:
        raise ValueError(f"--fidelity-settings takes settings like none,last:2, not {text!r}")
    return tuple(dict.fromkeys(out))
