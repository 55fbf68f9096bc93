"""TTFT against retrieved-context size, for every system on the same token sequence.

Systems (each timed from the call to the first sampled token):
- `full`: plain transformers prefill of the whole token sequence;
- `full_engine`: the engine's own full prefill of it, `PromptCache.generate(use_cache=False)` (the lean
  forward: the fastest full prefill this library has). `speedup` divides `full` (transformers'),
  `speedup_engine` divides `full_engine`;
- `prefix`: plain transformers with the KV of everything before the first module (chat prefix and
  system instructions) computed once and reused: the best prefix caching (vLLM, SGLang) can do when
  the retrieved chunks change from request to request;
- `cached_memory` / `cached_disk`: `PromptCache.generate` with every module in a MemoryStore (native
  tensors) / a DiskStore in a corpus's default codec (k6v6: decoded in the request, as a corpus ingested
  with the defaults serves it; page cache warm: read once before timing), the default planner: `cached_path` says
  whether it ran the cached plan or found a full prefill faster (engine/planning/costmodel.py). The worst
  `speedup_engine` over the prompts is "never slower than not caching" (target: at least 0.95x);
- `miss`: `PromptCache.generate` over a NullStore, so every module is encoded in the request;
- `lower_bound`: only the forward over the new tokens against an already assembled cache (cropped
  back between runs), i.e. what is left when fetching and assembly cost nothing;
- `llamacpp_bf16_full` / `llamacpp_q4_1_full` (where llama-cpp-python is installed, bench/llamacpp.py):
  llama.cpp's full prefill of the same token ids from the bf16 GGUF of the same weights and from the
  shipped Q4_1 GGUF. A shuffled document set gives llama.cpp's prefix reuse nothing past the system
  line, so full prefill is what it does here; `x_llamacpp_bf16` is its TTFT over our cached one.

The baselines get the token ids ready-made (no tokenizing), which only flatters them. Modules are
imported in a shuffled order, so relocation is always exercised. Not here: quality (quality.py).
"""

from __future__ import annotations

import random
import tempfile

import torch
from transformers import DynamicCache

from rag_promptcache.bench import llamacpp
from rag_promptcache.bench.common import (
    QUESTION,
    Bench,
    fit_question,
    interleaved,
    median,
    module_texts,
    schema_pml,
    timed,
)
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.kv.assemble import assemble
from rag_promptcache.engine.prompt.compiler import ROOT
from rag_promptcache.engine.compute.runner import cache_arg, forward_last, output_cache
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.rag.corpus_store import DEFAULT_CODEC
from rag_promptcache.store import DiskStore, MemoryStore, NullStore

SCHEMA = "bench_ttft"
QUERY_TOKENS = 32


def run(bench: Bench) -> list[dict[str, object]]:
    cfg, model, tok = bench.config, bench.model, bench.tokenizer
    num_modules = [max(1, c // cfg.module_tokens) for c in cfg.contexts]
    texts = module_texts(tok, max(num_modules), cfg.module_tokens)
    schema = schema_pml(SCHEMA, {f"d{i}": t for i, t in enumerate(texts)})
    question = fit_question(tok, QUESTION, QUERY_TOKENS)

    mem = PromptCache(model, tok, store=MemoryStore(), name=bench.model_name, **bench.engine_options)
    mem.add_schema(schema)
    report = mem.encode(SCHEMA)
    bench.log(f"ttft: encoded {report.num_modules} modules ({report.num_tokens} tokens) in {report.seconds:.1f} s")
    bench.extras["ttft_encode"] = report
    bench.extras["ttft_engine"] = mem
    rows = []
    with tempfile.TemporaryDirectory(prefix="rpc-bench-") as tmp:
        disk_store = DiskStore(tmp, codec=DEFAULT_CODEC)  # what `ingest` stores by default
        for key in mem.store.keys():
            disk_store.put(key, mem.store.get(key))
        disk = PromptCache(model, tok, store=disk_store, name=bench.model_name, **bench.engine_options)
        miss = PromptCache(model, tok, store=NullStore(), name=bench.model_name, **bench.engine_options)
        for pc in (disk, miss):
            pc.add_schema(schema)
        llama = llamacpp.runners(bench, max(cfg.contexts) + 256 + 4 * QUERY_TOKENS)
        for i, m in enumerate(num_modules):
            order = list(range(m))
            random.Random(m).shuffle(order)
            prompt = prompt_pml(SCHEMA, [f"d{j}" for j in order], [("user", question)])
            rows.append(_one(bench, prompt, m, question, mem, disk, miss, first=i == 0, llama=llama))
            r = rows[-1]
            bench.log(f"ttft {r['context_tokens']:>5} tok: full {r['full_s']:.3f} s, engine full {r['full_engine_s']:.3f}, "
                      f"prefix {r['prefix_s']:.3f}, "
                      f"memory {r['cached_memory_s']:.3f}, disk {r['cached_disk_s']:.3f}, miss {r['miss_s']:.3f}, "
                      f"lower bound {r['lower_bound_s']:.3f}; speed-up {r['speedup']:.1f}x over transformers' full, "
                      f"{r['speedup_engine']:.1f}x over the engine's"
                      + "".join(f"; llama.cpp {w} full {r[f'llamacpp_{w}_full_s']:.3f} s "
                                f"({r[f'x_llamacpp_{w}']:.1f}x our cached)" for w in (llama or ())))
        disk_store.close()
    worst = min(rows, key=lambda r: r["speedup_engine"])
    bench.log(f"ttft: worst cached/full ratio over {len(rows)} prompts {worst['speedup_engine']:.2f}x "
              f"(at {worst['context_tokens']} tokens, {worst['cached_path']} path; never slower means >= 0.95x)")
    return rows


@torch.inference_mode()
def _one(bench: Bench, prompt: str, m: int, question: str, mem: PromptCache, disk: PromptCache,
         miss: PromptCache, first: bool, llama: dict[str, llamacpp.Runner] | None = None) -> dict[str, object]:
    cfg, model, device = bench.config, bench.model, bench.device
    plan = mem.plan(prompt, fallback=False)  # the cached plan's pieces, whichever path `auto` would run
    assert not plan.misses, f"{plan.misses=}"
    ids = torch.tensor([[t for p in mem.plan(prompt, use_cache=False).pieces for t in p.token_ids]], device=device)
    n = ids.shape[1]
    num_prefix = 0  # tokens before the first module: what a prefix cache can reuse
    for p in plan.pieces:
        if p.unit not in (None, ROOT):
            break
        num_prefix += len(p.token_ids)
    prefix_out = model(input_ids=ids[:, :num_prefix], use_cache=True)
    prefix_kv = [(layer.keys, layer.values) for layer in output_cache(prefix_out).layers]
    prefix_pos = torch.arange(num_prefix, n, device=device)[None]

    def full() -> int:
        return int(model(input_ids=ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())

    def prefix() -> int:
        cache = DynamicCache(ddp_cache_data=prefix_kv, config=model.config)
        out = model(input_ids=ids[:, num_prefix:], position_ids=prefix_pos, use_cache=True, **cache_arg(model, cache),
                    logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    def engine(pc: PromptCache, missed: int) -> callable:
        def go() -> int:
            res = pc.generate(prompt, max_new_tokens=1)
            assert len(res.missed_modules) == missed, f"{res.missed_modules=} {missed=}"
            return res.token_ids[0]
        return go

    asm = assemble(plan.pieces, plan.kvs, mem.relocator, model.config, mem.geometry, device, model.dtype)

    def lower_bound() -> int:
        extra = asm.cache.get_seq_length() - asm.num_cached
        if extra:
            asm.cache.crop(-extra)  # back to the assembled cache: transformers 5 crops by tokens to remove
        return int(forward_last(model, asm.new_ids, asm.new_positions, asm.cache, asm.mask).argmax())

    def plan_only() -> object:
        return mem.plan(prompt)

    def assemble_only() -> object:
        return assemble(plan.pieces, plan.kvs, mem.relocator, model.config, mem.geometry, device, model.dtype)

    def full_engine() -> int:
        return mem.generate(prompt, use_cache=False, max_new_tokens=1).token_ids[0]

    slow_warm = cfg.warmup if (first or cfg.warmup_each_context) else 0
    id_list = ids[0].tolist()
    llama_systems = {f"llamacpp_{w}_full": (lambda r=r: r.full(id_list)[1], cfg.repeats_slow, slow_warm)
                     for w, r in (llama or {}).items()}
    times = interleaved({
        "full": (full, cfg.repeats_slow, slow_warm),
        "full_engine": (full_engine, cfg.repeats_slow, slow_warm),
        "prefix": (prefix, cfg.repeats_slow, slow_warm),
        "miss": (engine(miss, m), cfg.repeats_slow, slow_warm),
        "cached_memory": (engine(mem, 0), cfg.repeats_fast, cfg.warmup),
        "cached_disk": (engine(disk, 0), cfg.repeats_fast, max(1, cfg.warmup)),  # the warm-up warms the page cache
        "lower_bound": (lower_bound, cfg.repeats_fast, cfg.warmup),
        "plan": (plan_only, cfg.repeats_fast, cfg.warmup),
        "assemble": (assemble_only, cfg.repeats_fast, cfg.warmup),
        **llama_systems,
    }, device, bench.min_span_s)
    s = {k: median(v) for k, v in times.items()}
    top_full, cached = timed(full, device)[1], mem.generate(prompt, max_new_tokens=1)
    assert not cached.missed_modules, f"{cached.missed_modules=}"
    top_cached, path = cached.token_ids[0], cached.path  # path: which one the default planner runs for this prompt
    llama_fields: dict[str, object] = {}
    for w, r in (llama or {}).items():
        llama_fields[f"llamacpp_{w}_full_s"] = s[f"llamacpp_{w}_full"]
        llama_fields[f"x_llamacpp_{w}"] = s[f"llamacpp_{w}_full"] / s["cached_memory"]  # llama.cpp over our cached
        llama_fields[f"llamacpp_{w}_top1_match"] = r.full(id_list)[1] == top_full
    if llama:
        llama_fields["llamacpp_tokens"] = llamacpp.token_check(next(iter(llama.values())), bench.tokenizer, id_list)
        llama_fields["llamacpp"] = llamacpp.info(bench)
    return {
        # the retrieved modules' tokens, counted before recovery turns some of them into new tokens
        "context_tokens": sum(len(p.token_ids) for p in mem.plan(prompt, recovery="none", fallback=False).pieces
                              if p.unit not in (None, ROOT)),
        "recovery": str(mem.recovery),
        "modules": m,
        "query_tokens": len(bench.tokenizer(question, add_special_tokens=False)["input_ids"]),
        "prompt_tokens": n,
        "prefix_tokens": num_prefix,
        "new_tokens": int(asm.new_ids.shape[1]),
        "full_s": s["full"],
        "full_engine_s": s["full_engine"],
        "prefix_s": s["prefix"],
        "cached_memory_s": s["cached_memory"],
        "cached_disk_s": s["cached_disk"],
        "miss_s": s["miss"],
        "lower_bound_s": s["lower_bound"],
        "speedup": s["full"] / s["cached_memory"],  # over transformers' full prefill
        "speedup_engine": s["full_engine"] / s["cached_memory"],  # over the engine's own
        "cached_path": path,  # "cached", or "full" where the cost model found a full prefill faster
        "overhead_vs_lower_bound": s["cached_memory"] / s["lower_bound"],
        "prefix_speedup": s["full"] / s["prefix"],
        "miss_over_full": s["miss"] / s["full"],
        "disk_over_memory": s["cached_disk"] / s["cached_memory"],
        "plan_s": s["plan"],  # fetch from the memory tier, compile: part of cached_memory_s
        "assemble_s": s["assemble"],  # concatenate, relocate, build the cache: part of cached_memory_s
        "top1_match": top_full == top_cached,
        **llama_fields,
        "runs": {k: [round(x, 5) for x in v] for k, v in times.items()},
    }
