"""What the harnesses here share: the command line that loads a model into a `Bench` (the object every
`rag-promptcache bench` scenario runs on), and writing a run's JSON and Markdown into a folder.

Not here: any harness's logic, or the package's scenarios (rag_promptcache/bench/).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rag_promptcache.bench.common import Bench


def parser(description: str) -> argparse.ArgumentParser:
    """The options every harness that loads a model takes, as `rag-promptcache bench` names them."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model name, hub id, directory or .gguf")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... [default: cuda if present, else cpu]")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    ap.add_argument("--adapter", default="default", metavar="PATH|default|none", help="the tuned adapter merged into the model")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads [default: torch's]")
    ap.add_argument("--quick", action="store_true", help="the sizes of `bench --quick` (BenchConfig.quick)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the run's JSON (and Markdown where it has one)")
    return ap


def load(args: argparse.Namespace) -> Bench:
    """The model `args` names, loaded as `rag-promptcache bench` loads it."""
    import torch

    from rag_promptcache.bench.common import Bench, BenchConfig
    from rag_promptcache.model.loading import load_model, parse_dtype

    parse_dtype(args.dtype)  # a bad name fails before the model loads
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = BenchConfig.quick() if args.quick else BenchConfig.full()
    config = dataclasses.replace(config, dtype=args.dtype, adapter=args.adapter)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, device=device, dtype=config.dtype, adapter=config.adapter)
    print(f"loaded {args.model} on {model.device} ({model.dtype}) in {time.perf_counter() - t0:.1f} s", flush=True)
    return Bench(model, tokenizer, args.model, config, log=lambda m: print(m, flush=True))


def write(bench: Bench, quick: bool, folder: Path, name: str, result: dict[str, object],
          markdown: str = "") -> dict[str, object]:
    """`name`.json in `folder`: the run's description (`rag_promptcache.bench.describe`, as `bench`'s report
    has it) and `result` under `name`; `name`.md beside it where there is Markdown, which is printed too."""
    from rag_promptcache.bench import describe, report

    out = {**describe(bench, quick), name: result}
    folder.mkdir(parents=True, exist_ok=True)
    report.write_json(out, folder / f"{name}.json")
    if markdown:
        (folder / f"{name}.md").write_text(markdown + "\n")
        print(markdown, flush=True)
    print(f"wrote {folder / name}.json", flush=True)
    return out
