"""The benchmark: TTFT, quality, memory, throughput and LangChain end to end, on one loaded model.

    from rag_promptcache.bench import run
    report = run(quick=True, json_path="out/bench.json", plots_dir="out")

Every scenario compares systems on the same token sequence inside one run, so ratios hold on a
shared, noisy machine even when absolute times wander. One file per scenario; `report.py` writes
the JSON, the Markdown table and the plots. Not here: assertions on speed (docs/benchmarks.md records the
numbers; tests/test_bench.py checks the report's shape only).
"""

from __future__ import annotations

import datetime
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rag_promptcache.bench.common import Bench, BenchConfig

SCENARIOS = ("ttft", "quality", "memory", "throughput", "langchain", "decode", "fidelity", "ingest", "serve", "chat",
             "sustained", "json")
# fidelity (answers on confusable documents), ingest (local vs Ray), serve (concurrent HTTP clients), sustained
# (novel questions against tiers smaller than the corpus) and json (json_object answers under a small budget) build
# their own corpus and take minutes: only when asked for (--scenarios fidelity,ingest,serve,sustained,json).
# The harnesses only the project runs (the fuzz and soak runs, retrieval on real manuals, the large sustained run,
# the fidelity sweeps' runner, the shape and Ray replica benches) live in the repository's benchmarks/, outside
# the package: benchmarks/README.md.
DEFAULT_SCENARIOS = ("ttft", "quality", "memory", "throughput", "langchain", "decode")
# the scenarios that became harnesses in benchmarks/: what `bench` answers a name of them with
HARNESSES = {"fuzz": "python -m benchmarks.soak --fuzz", "soak": "python -m benchmarks.soak",
             "retrieval": "python -m benchmarks.retrieval"}


def run(
    quick: bool = False,
    json_path: str | Path | None = None,
    plots_dir: str | Path | None = None,
    model: str = "smollm2-135m-instruct",
    device: str | None = None,
    *,
    config: BenchConfig | None = None,
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS,
    log: Callable[[str], None] = print,
) -> dict[str, object]:
    """Load `model` on `device` (CUDA when present, else CPU), run the scenarios, write the outputs."""
    from rag_promptcache.model.loading import load_model

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = config or (BenchConfig.quick() if quick else BenchConfig.full())
    t0 = time.perf_counter()
    hf_model, tokenizer = load_model(model, device=device, dtype=config.dtype, adapter=config.adapter)
    log(f"loaded {model} on {hf_model.device} ({hf_model.dtype}) in {time.perf_counter() - t0:.1f} s")
    bench = Bench(hf_model, tokenizer, model, config, log)
    return run_loaded(bench, quick, json_path, plots_dir, scenarios)


def run_loaded(
    bench: Bench,
    quick: bool,
    json_path: str | Path | None = None,
    plots_dir: str | Path | None = None,
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS,
) -> dict[str, object]:
    """Run the scenarios on an already loaded model (tests use a tiny one)."""
    from rag_promptcache.bench import (
        decode,
        fidelity,
        langchain_e2e,
        memory,
        quality,
        report,
        throughput,
        ttft,
    )

    if unknown := set(scenarios) - set(SCENARIOS):
        raise ValueError(f"unknown scenario(s) {sorted(unknown)}; valid: {', '.join(SCENARIOS)}")
    bench.log(f"clock resolution {bench.resolution_s:.3g} s: each timed run spans at least {bench.min_span_s:.3g} s")
    out: dict[str, object] = {**describe(bench, quick), "ttft": [], "quality": [], "memory": [],
                              "langchain": {"skipped": "not run"}}
    seconds: dict[str, float] = {}
    t_all = time.perf_counter()
    for name in SCENARIOS:
        if name not in scenarios:
            continue
        t0 = time.perf_counter()
        if name == "ttft":
            out["ttft"] = ttft.run(bench)
        elif name == "quality":
            out["quality"] = quality.run(bench)
        elif name == "memory":
            mem = memory.run(bench)
            out["memory"] = mem.pop("memory")
            out.update(mem)
        elif name == "decode":
            out["decode"] = decode.run(bench)
            out["decode_answers"] = decode.answers(bench)
        elif name == "throughput":
            out["throughput"] = throughput.run(bench)
        elif name == "fidelity":
            out["fidelity"] = fidelity.run(bench)
        elif name == "ingest":
            from rag_promptcache.bench import ingest

            out["ingest"] = ingest.run(bench)
        elif name == "serve":
            from rag_promptcache.bench import serve

            out["serve"] = serve.run(bench, llama_server=bench.config.llama_server, admission=bench.config.serve_admission)
        elif name == "chat":  # chat turns over the same documents, against llama.cpp's prefix reuse where installed
            from rag_promptcache.bench import chat

            out["chat"] = chat.run(bench)
        elif name == "sustained":
            from rag_promptcache.bench import sustained

            out["sustained"] = sustained.run(bench)
        elif name == "json":
            from rag_promptcache.bench import structured

            out["json"] = structured.run(bench)
        else:
            out["langchain"] = langchain_e2e.run(bench)
        seconds[name] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_all
    out["seconds"] = seconds
    text = report.markdown(out)
    bench.log("\n" + text)
    if json_path is not None:
        report.write_json(out, json_path)
    if plots_dir is not None:
        Path(plots_dir).mkdir(parents=True, exist_ok=True)
        (Path(plots_dir) / "bench.md").write_text(text + "\n")
        out_plots = report.plots(out, plots_dir)
        bench.log("wrote " + ", ".join(str(p) for p in [Path(plots_dir) / "bench.md", *out_plots]))
    return out


def describe(bench: Bench, quick: bool) -> dict[str, object]:
    """What a report says of the run it comes from: the model, the machine, the clock (and the harnesses in
    the repository's benchmarks/ write it too)."""
    from rag_promptcache.bench.fidelity_reference import adapter_label
    from rag_promptcache.engine.compute import attention
    from rag_promptcache.model.loading import cpu_flags

    dev = bench.device
    return {
        "model": bench.model_name,
        "device": f"cuda: {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else dev.type,
        "threads": torch.get_num_threads(),
        "dtype": str(bench.model.dtype).removeprefix("torch."),
        "quick": quick,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "torch": torch.__version__,
        "cpu_flags": list(cpu_flags()),
        # model/native.py's kernels (prefill attention, key relocation) ran for this run's bf16 CPU model
        "native_kernels": attention.available(bench.model.dtype, dev),
        "adapter": adapter_label(bench.model),  # the tuned adapter merged into the model, or "none"
        "recovery": bench.config.recovery,  # `--recovery` (the TTFT, LangChain and serve runs); None: the engine's default
        # the clock's step when the run started, and the span every timed run covers (bench/common.py)
        "clock_resolution_s": bench.resolution_s, "clock_min_span_s": bench.min_span_s,
    }
