"""How far does the measured pace of real prefills stray from the cost model's calibration? The numbers
behind `costmodel.DRIFT`, the drift at which a stored calibration is measured again.

    python -m research.pace_drift --requests 12 --modules 12 --json out/pace_drift.json

On the default model (its default dtype and threads), in three phases, each with its own engine and a
`PaceMeter` that records every sample (measured / modelled seconds of at least `MIN_SPAN_S` of
prefills and encodings) and the moving average the planner reads:

- `fresh`: calibrated now, then `--requests` requests;
- `busy_calibration`: calibrated while `--spinners` processes (one per core by default) spin, then the
  same requests after they stop: the calibration a loaded moment leaves behind;
- `busy_run`: calibrated now, then the requests while the spinners spin: load the pace should absorb.

Each request imports 2 to 8 of `--modules` (24) modules of 256 tokens (the bench's pydoc topics), in a random
order, with the default recovery, and decodes one token: a pace sample is a prefill or an encoding.
Calibrations go to a temporary folder, never the user's. Prints (and writes with `--json`) per phase
the raw samples, the moving average after each, and the 1-minute load average at its start.

Not here: choosing the threshold (engine/planning/costmodel.py says what was chosen and why) or
anything on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

SPIN = "while True:\n    pass\n"


def spinners(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=10)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(prog="python -m research.pace_drift", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--modules", type=int, default=24)
    ap.add_argument("--spinners", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default="fresh,busy_calibration,busy_run", help="Comma-separated, of the three.")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if bad := set(args.phases.split(",")) - {"fresh", "busy_calibration", "busy_run"}:
        ap.error(f"unknown phase(s) {sorted(bad)}; valid: fresh, busy_calibration, busy_run")
    os.environ["RAG_PROMPTCACHE_COSTS_DIR"] = tempfile.mkdtemp(prefix="pace-drift-")

    from rag_promptcache.bench.common import module_texts, schema_pml
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.engine.planning import costmodel
    from rag_promptcache.engine.planning.costmodel import Fallback, PaceMeter
    from rag_promptcache.model.loading import load_model
    from rag_promptcache.store import MemoryStore

    class Recording(PaceMeter):
        def __init__(self) -> None:
            super().__init__()
            self.samples: list[float] = []
            self.factors: list[float] = []

        def ran(self, modelled_s: float, seconds: float) -> None:
            before, log_before = self.num_samples, (None if self.num_samples == 0 else math.log(self.factor))
            super().ran(modelled_s, seconds)
            if self.num_samples > before:
                now = math.log(self.factor)
                raw = now if log_before is None else (now - (1 - costmodel.PACE_ALPHA) * log_before) / costmodel.PACE_ALPHA
                self.samples.append(round(math.exp(raw), 3))
                self.factors.append(round(self.factor, 3))

    model, tokenizer = load_model()
    names = [f"m{i}" for i in range(args.modules)]
    schema = schema_pml("drift", dict(zip(names, module_texts(tokenizer, len(names), 256), strict=True)))
    rng = random.Random(args.seed)
    prompts = []
    for i in range(args.requests):
        chosen = rng.sample(names, rng.randint(2, min(8, len(names))))
        body = "".join(f"<{m}/>" for m in chosen)
        prompts.append(f'<prompt schema="drift">{body}<user>Question {i}: what do these sections say about '
                       f'{rng.choice(["names", "scopes", "operators", "exceptions"])}?</user></prompt>')

    def engine() -> tuple[PromptCache, Recording]:
        pace = Recording()
        pc = PromptCache(model, tokenizer, store=MemoryStore(), prefix_cache_bytes=0,
                         fallback=Fallback("auto", lambda: costs, pace=pace))
        pc.add_schema(schema)
        return pc, pace

    def calibrate() -> costmodel.Costs:
        pc = PromptCache(model, tokenizer, store=MemoryStore(), prefix_cache_bytes=0)
        return costmodel.calibrate(pc.model, pc.relocator, pc.geometry)

    out: dict[str, object] = {"model": str(model.config._name_or_path), "dtype": str(model.dtype),
                              "requests": args.requests, "spinners": args.spinners}
    for phase in args.phases.split(","):
        load = os.getloadavg()[0]
        spin = spinners(args.spinners) if phase == "busy_calibration" else []
        try:
            costs = calibrate()
        finally:
            stop(spin)
        if phase == "busy_calibration":
            time.sleep(2)
        spin = spinners(args.spinners) if phase == "busy_run" else []
        try:
            pc, pace = engine()
            for prompt in prompts:
                pc.generate(prompt, max_new_tokens=1)
        finally:
            stop(spin)
        s = pace.samples
        row = {"load_at_start": round(load, 2), "costs": {k: float(f"{v:.4g}") for k, v in asdict(costs).items()},
               "samples": s, "factors": pace.factors, "final_factor": pace.factors[-1] if s else None,
               "median_sample": statistics.median(s) if s else None, "min_sample": min(s, default=None),
               "max_sample": max(s, default=None)}
        out[phase] = row
        print(phase, json.dumps({k: v for k, v in row.items() if k not in ("samples", "factors")}), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
