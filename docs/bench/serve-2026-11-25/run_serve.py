"""The run behind this folder: bench/serve.py's scenario at fewer levels, whole prefills (the batcher
before chunked prefill) against chunked ones, each behind its own server over one engine and corpus.

    PYTHONPATH=. python docs/bench/serve-2026-11-25/run_serve.py OUT.json LEVELS REPEATS CHUNK...
    e.g. ... serve.json 1,4,8,16 1 none 64      ("none": whole prefills)
"""

import json
import os
import sys

import torch

from rag_promptcache.bench.common import Bench, BenchConfig
from rag_promptcache.bench import serve
from rag_promptcache.model.loading import load_model

out, levels, repeats, *chunks = sys.argv[1:]
torch.set_num_threads(2)
model, tokenizer = load_model("smollm2-135m-instruct")
bench = Bench(model, tokenizer, "smollm2-135m-instruct", BenchConfig())
load = [os.getloadavg()]
result = serve.run(bench, levels=tuple(int(n) for n in levels.split(",")), repeats=int(repeats),
                   prefill_chunks=tuple(None if c == "none" else int(c) for c in chunks))
load.append(os.getloadavg())
result |= {"threads": 2, "dtype": str(model.dtype), "loadavg_before_after": load}
with open(out, "w") as f:
    json.dump(result, f, indent=1)
print("\n".join(serve.markdown(result)))
