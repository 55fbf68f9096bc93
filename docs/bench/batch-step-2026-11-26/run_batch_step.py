"""The run behind this folder: one batched decode step of B rows at a 2k-token context (engine/batching/batch.py
`decode_step`), SmolLM2-135M-Instruct in bf16, 2 threads, the native batch kernel against the torch
forward (RAG_PROMPTCACHE_KERNELS=0 read per call), interleaved, each the median of REPEATS steps.

    PYTHONPATH=. python docs/bench/batch-step-2026-11-26/run_batch_step.py OUT.json [CONTEXT] [REPEATS]
"""

import json
import os
import statistics
import sys
import time

import torch

from rag_promptcache.engine.batching.batch import BatchCache, decode_step
from rag_promptcache.model import native
from rag_promptcache.model.loading import load_model
from rag_promptcache.model.positions import kv_geometry

out = sys.argv[1]
context = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 20
torch.set_num_threads(2)
model, _ = load_model("smollm2-135m-instruct", dtype="bfloat16")
batch = BatchCache(model.config, kv_geometry(model), 16, context + repeats * 4 + 8, model.dtype, model.device)
with torch.inference_mode():
    batch.keys.normal_(0, 0.5)
    batch.values.normal_(0, 0.5)


def step_s(rows: int) -> float:
    batch.lengths[:rows] = [context - r for r in range(rows)]  # rows of their own lengths, about `context`
    t0 = time.perf_counter()
    decode_step(model, batch, [100 + r for r in range(rows)], batch.lengths[:rows])
    return time.perf_counter() - t0


def kernels(on: bool) -> None:
    os.environ[native.KERNELS_ENV] = "1" if on else "0"


# interleaved: each repeat times both at each batch size, so a load spike on the shared machine hits both
load = [os.getloadavg()]
times: dict[str, dict[int, list[float]]] = {"native": {}, "torch": {}}
for rows in (1, 2, 4, 8, 16):
    for i in range(repeats + 2):
        for name in ("native", "torch"):
            kernels(name == "native")
            t = step_s(rows)
            if i >= 2:  # two warm-ups
                times[name].setdefault(rows, []).append(t)
load.append(os.getloadavg())
result = {"context": context, "repeats": repeats, "threads": 2, "dtype": "bfloat16", "loadavg_before_after": load,
          "median_s": {name: {rows: statistics.median(ts) for rows, ts in by.items()} for name, by in times.items()},
          "all_s": times}
with open(out, "w") as f:
    json.dump(result, f, indent=1)
for name, by_rows in result["median_s"].items():
    one = by_rows[1]
    print(name, " ".join(f"B={b}: {s * 1e3:.1f} ms ({s / one:.2f}x)" for b, s in by_rows.items()))
print("native/torch", " ".join(f"B={b}: {result['median_s']['native'][b] / result['median_s']['torch'][b]:.2f}"
                                for b in result["median_s"]["torch"]))
print("load", load)
