"""bench's ingest scenario without the Ray rows (one thread beside the large sustained run)."""
import dataclasses, json, sys
import torch
from rag_promptcache.bench import ingest
from rag_promptcache.bench.common import Bench, BenchConfig
from rag_promptcache.model.loading import load_model

torch.set_num_threads(1)
cfg = dataclasses.replace(BenchConfig.full(), ingest_workers=(), dtype="bfloat16")
model, tok = load_model("smollm2-135m-instruct", device="cpu", dtype=cfg.dtype, adapter=cfg.adapter)
bench = Bench(model, tok, "smollm2-135m-instruct", cfg, lambda m: print(m, flush=True))
out = ingest.run(bench)
json.dump(out, open(sys.argv[1], "w"), indent=1, default=str)
print("\n".join(ingest.markdown(out)))
