"""Cached TTFT over a memory tier, interleaved in one process: native modules, int8 and k6v6 each decoded by
the torch path (the native decode kernel switched off around its calls) and by the native kernel. The default
model (bf16, shipped adapter, default recovery last:1), 256-token modules, k = 4, 8, 12."""
import json, random, statistics, sys, time
import torch
from rag_promptcache.model.loading import load_model
from rag_promptcache.engine import PromptCache
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.store import MemoryStore, codecs
from rag_promptcache.bench.common import QUESTION, module_texts, schema_pml, fit_question
rounds = int(sys.argv[1]); out = sys.argv[2]
real = codecs._native_dequantize
model, tok = load_model(dtype="bfloat16")
texts = module_texts(tok, 12, 256)
schema = schema_pml("c", {f"d{i}": t for i, t in enumerate(texts)})
q = fit_question(tok, QUESTION, 32)
base = PromptCache(model, tok, store=MemoryStore(), prefix_cache_bytes=0)
base.add_schema(schema); base.encode("c")
variants = [("native", "native", True), ("int8 torch", "int8", False), ("int8 kernel", "int8", True),
            ("k6v6 torch", "k6v6", False), ("k6v6 kernel", "k6v6", True)]
engines = {}
for name, c, _ in variants:
    st = MemoryStore(codec=c)
    for key in base.store.keys():
        st.put(key, base.store.get(key))
    pc = PromptCache(model, tok, store=st, prefix_cache_bytes=0, fallback="never")
    pc.add_schema(schema); engines[name] = pc
prompts = {}
for k in (4, 8, 12):
    order = list(range(k)); random.Random(k).shuffle(order)
    prompts[k] = prompt_pml("c", [f"d{j}" for j in order], [("user", q)])
def run(name, kernel, p):
    codecs._native_dequantize = real if kernel else (lambda *a: None)
    try:
        t = time.perf_counter(); engines[name].generate(p, max_new_tokens=1); return time.perf_counter() - t
    finally:
        codecs._native_dequantize = real
times = {(n, k): [] for n, _, _ in variants for k in prompts}
for n, _, kern in variants:
    for k in prompts: run(n, kern, prompts[k])
for r in range(rounds):
    for k, p in prompts.items():
        for n, _, kern in (variants if r % 2 == 0 else variants[::-1]):
            times[(n, k)].append(run(n, kern, p))
res = {f"{n} k={k}": {"median_s": statistics.median(v), "times_s": v} for (n, k), v in times.items()}
json.dump(res, open(out, "w"), indent=1)
for k in prompts:
    print(f"k={k}", "  ".join(f"{n} {statistics.median(times[(n, k)])*1e3:.1f}" for n, _, _ in variants))
