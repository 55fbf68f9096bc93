"""One batched decode step (`engine/batching/batch.py` `decode_step`, the native batch call) of 1-16 rows at
~900 tokens of context each, the shipped model in bf16, 2 threads: median of 30 steps per row count.

    PYTHONPATH=. python docs/bench/serve-2026-12-03/step.py
"""
import time, torch, statistics
torch.set_num_threads(2)
from rag_promptcache.engine.engine import PromptCache
from rag_promptcache.engine.batching.batch import BatchCache, decode_step
eng = PromptCache.from_pretrained()
model = eng.model
print(model.dtype)
g = eng.geometry
batch = BatchCache(model.config, g, 16, 1024, model.dtype, model.device)
with torch.inference_mode():
    batch.keys.normal_(); batch.values.normal_()
for n in (1, 2, 4, 8, 16):
    times = []
    for rep in range(30):
        for r in range(n): batch.lengths[r] = 900 + r
        t = time.perf_counter()
        decode_step(model, batch, [100 + r for r in range(n)], [900 + r for r in range(n)])
        times.append(time.perf_counter() - t)
    print(n, f"median {statistics.median(times)*1e3:.1f} ms, per token {statistics.median(times)*1e3/n:.1f}")
