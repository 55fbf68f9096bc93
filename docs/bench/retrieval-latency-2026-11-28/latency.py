"""bench's retrieval latency alone: the manuals corpus (lazy: retrieval needs no KV), 20 questions,
10k and 100k modules, one search per mode with the question's embedding."""
import dataclasses, json, sys, tempfile
from pathlib import Path
import torch
from benchmarks import retrieval, retrieval_data
from rag_promptcache.bench.common import Bench, BenchConfig
from rag_promptcache.model.loading import load_model
from rag_promptcache.rag.corpus import Corpus

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
cfg = dataclasses.replace(BenchConfig.full(), dtype="bfloat16")
model, tok = load_model("smollm2-135m-instruct", device="cpu", dtype=cfg.dtype, adapter=cfg.adapter)
bench = Bench(model, tok, "smollm2-135m-instruct", cfg, lambda m: print(m, flush=True))
pages, questions = retrieval_data.load()
with tempfile.TemporaryDirectory() as tmp:
    corpus = Corpus.build([p for ps in pages.values() for p in ps], f"{tmp}/m", model="smollm2-135m-instruct",
                          kv="lazy", progress=False, redis_url="")
    rows = retrieval.latency(bench, corpus, [q.question for q in questions[:retrieval.LATENCY_QUESTIONS]],
                             retrieval.SCALES, Path(tmp))
    corpus.close()
for r in rows:
    print(r, flush=True)
json.dump({"threads": torch.get_num_threads(), "rows": rows}, open(sys.argv[1], "w"), indent=1)
