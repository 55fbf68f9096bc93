"""Decode at ~2k context: the engine's plain decode (prompt_lookup 0) and its default, against llama.cpp bf16/Q4_1,
interleaved round by round, on the same token ids (the decode scenario's prompt shape)."""
import dataclasses, json, sys, torch
torch.set_num_threads(2)
from rag_promptcache.bench import llamacpp
from rag_promptcache.bench.common import Bench, BenchConfig, QUESTION, fit_question, interleaved, median, module_texts, schema_pml
from rag_promptcache.engine import PromptCache
from rag_promptcache.model.loading import load_model
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.store import MemoryStore

n, rounds = int(sys.argv[1]), int(sys.argv[2])
model, tok = load_model(dtype="bfloat16")
cfg = dataclasses.replace(BenchConfig.quick(), decode_tokens=n, repeats_slow=rounds)
bench = Bench(model, tok, "smollm2-135m-instruct", cfg)
m = cfg.decode_context // cfg.module_tokens
schema = schema_pml("bench_decode", {f"d{i}": t for i, t in enumerate(module_texts(tok, m, cfg.module_tokens))})
prompt = prompt_pml("bench_decode", [f"d{i}" for i in reversed(range(m))], [("user", fit_question(tok, QUESTION, 32))])
store = MemoryStore()
engines = {}
for lookup in (0, 8):
    pc = PromptCache(model, tok, store=store, name=bench.model_name, prompt_lookup=lookup)
    pc.add_schema(schema)
    engines[lookup] = pc
engines[0].encode("bench_decode")
ids = [t for p in engines[0].plan(prompt, use_cache=False).pieces for t in p.token_ids]
rs = llamacpp.runners(bench, len(ids) + n + 64)
res = {f"engine_lookup{k}": [] for k in engines} | {f"llamacpp_{w}": [] for w in rs}
toks = {}
def eng(k):
    def go():
        r = engines[k].generate(prompt, max_new_tokens=n, ignore_eos=True)
        res[f"engine_lookup{k}"].append((n - 1) / (r.total_s - r.ttft_s)); toks[f"engine_lookup{k}"] = list(r.token_ids)
    return go
def lc(w):
    def go():
        rs[w].llm.reset(); rs[w].state.clear()
        d, _, t = rs[w].decode(ids, n)
        res[f"llamacpp_{w}"].append((n - 1) / d); toks[f"llamacpp_{w}"] = t
    return go
systems = {k: (eng(k), rounds, 1) for k in engines} | {w: (lc(w), rounds, 1) for w in rs}
interleaved({str(k): v for k, v in systems.items()}, bench.device)
for k in res: res[k] = [x for x in res[k][1:]]  # drop the warm-up
out = {"context_tokens": len(ids), "new_tokens": n, "rounds": rounds, "tokens_per_s": {k: median(v) for k, v in res.items()},
       "runs": res, "same_tokens_as_engine_plain": {k: toks[k] == toks["engine_lookup0"] for k in toks}}
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[3], "w"), indent=1)
