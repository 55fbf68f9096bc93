"""TTFT and decode at a model shape, with random weights made on the device: timings only, no answer judged.

    python -m benchmarks.shape --shape llama-3.1-8b --contexts 4096,8192,16384,32768 --json out/shape.json

`SHAPES` holds Llama-3.1-8B's config (32 layers, hidden 4096, 8 KV heads, llama3 RoPE scaling; about
16 GB of bf16 weights, created under the device so nothing large crosses a call) and a tiny one that
runs the same code on the CPU in the tests. The prompts are the bench's own (bench/common.py: the
pydoc topics, the default model's tokenizer, whose ids fit either vocabulary): `layout(context)` takes
k = context / 512 modules of 512 tokens up to 32 of them, and at 32k 32 modules of 1,024.

Per context, interleaved, median of runs, each from the call to the first token:
- `full_s`: transformers' full prefill of the same token ids (SDPA), the baseline;
- `full_engine_s`: the engine's own full prefill (`generate(use_cache=False)`), what its fallback runs;
- `none_host_s`, `none_gpu_s`: the cached path with `recovery="none"`, the modules in pinned host
  memory (loaded layer by layer, engine/kv/stream.py) or in a GPU tier (store/device.py);
- `default_host_s`, `default_gpu_s`: the same with the engine's default recovery;
- `auto_s`, `auto_path`: the default engine as a user gets it (default recovery, modules in host
  memory, the cost model's fallback, calibrated on this device): never slower than full prefill means
  `full_s / auto_s` >= 0.95.

Decode (`decode`): 128 greedy tokens after the first context's prompt, EOS ignored: the engine with CUDA
graphs, with and without prompt lookup, and its eager step; transformers' `generate` with its dynamic
cache, and with a static cache (transformers compiles that step itself) where `--budget-s` leaves time.
On random weights greedy text soon repeats, which prompt lookup drafts well: its rows flatter it.

The JSON is written after every context, so a run cut short keeps what it measured;
scripts/bench_tables.py turns it into tables (kinds shape-ttft, shape-decode).
Out of scope: answer quality (random weights), other shapes than the table's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from transformers import (AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase,
                          StaticCache)

from rag_promptcache.bench.common import QUESTION, fit_question, interleaved, median, module_texts, schema_pml, timed
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.compute.graphs import GRAPHS_ENV, graphs_enabled
from rag_promptcache.engine.compute.runner import cache_arg
from rag_promptcache.engine.decoding.lookup import DEFAULT_LOOKUP
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.store import DeviceStore, MemoryStore, TieredStore
from rag_promptcache.timing import MIN_STEPS, describe, ratio, resolution

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict[str, object]] = {
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False, rms_norm_eps=1e-5),
    # the same code on the CPU in the tests: the default tokenizer's ids (49,152) fit its vocabulary
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, max_position_embeddings=131072,
                 rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
}
MODULE_TOKENS, MAX_MODULES = 512, 32
QUERY_TOKENS = 32
COMPILE_S = 120  # budget seconds left that transformers' static-cache compilation is started with
SCHEMA = "bench_shape"


def shape_config(name: str) -> PretrainedConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; valid: {', '.join(SHAPES)}")
    return AutoConfig.for_model("llama", **SHAPES[name])


def random_model(name: str, device: str | torch.device, dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """A model of shape `name` with random weights, made on `device` itself (seeded: the same weights per device)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(shape_config(name), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def layout(context: int) -> tuple[int, int]:
    """(modules, tokens per module) for `context` retrieved tokens: 512-token modules, at most 32."""
    k = max(1, min(MAX_MODULES, context // MODULE_TOKENS))
    return k, context // k


def run(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, shape: str, contexts: list[int], *,
        repeats: int = 3, decode_tokens: int = 128, budget_s: float = 240.0, json_path: Path | None = None,
        log=print) -> dict[str, object]:
    t_start = time.perf_counter()
    dev = model.device
    out: dict[str, object] = {
        "kind": "shape", "shape": shape, "model": f"random weights, {shape} shape",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"cuda: {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else dev.type,
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
        "threads": torch.get_num_threads(), "dtype": str(model.dtype).removeprefix("torch."),
        "torch": torch.__version__, "transformers": transformers.__version__, "ttft": [], "decode": [],
        "clock_resolution_s": resolution(),
    }
    # each timed run spans this much, a mean over repeated calls where one is shorter (bench/common.py)
    out["clock_min_span_s"] = min_span_s = MIN_STEPS * out["clock_resolution_s"]
    left = lambda: budget_s - (time.perf_counter() - t_start)  # noqa: E731
    prompts = {}
    for context in contexts:
        if left() < 0:
            log(f"shape: budget spent, context {context} not measured")
            out.setdefault("skipped", []).append(f"ttft at {context}")
            continue
        row, prompts[context] = _ttft(model, tokenizer, context, repeats, log, min_span_s)
        out["ttft"].append(row)
        _write(out, json_path)
    if prompts and left() > 0:
        first = min(prompts)
        out["decode"] = _decode(model, tokenizer, *prompts[first], first, decode_tokens, repeats, left, log, min_span_s)
    out["seconds"] = time.perf_counter() - t_start
    _write(out, json_path)
    return out


def _engines(model, tokenizer, schema: str, gpu_bytes: int) -> dict[str, PromptCache]:
    host = MemoryStore()  # pinned where CUDA is present: the default engine's store
    common = {"prefix_cache_bytes": 0}
    engines = {
        "host": PromptCache(model, tokenizer, store=host, fallback="never", **common),
        "gpu": PromptCache(model, tokenizer, store=TieredStore([DeviceStore(gpu_bytes, model.device), host]),
                           fallback="never", **common),
        "auto": PromptCache(model, tokenizer, store=host, fallback="auto", **common),
    }
    for pc in engines.values():
        pc.add_schema(schema)
    return engines


def _ttft(model, tokenizer, context: int, repeats: int, log, min_span_s: float) -> tuple[dict[str, object], tuple]:
    k, size = layout(context)
    names = [f"c{context}_{i}" for i in range(k)]
    schema = schema_pml(SCHEMA + str(context), dict(zip(names, module_texts(tokenizer, k, size))))
    question = fit_question(tokenizer, QUESTION, QUERY_TOKENS)
    prompt = prompt_pml(SCHEMA + str(context), list(reversed(names)), [("user", question)])
    kv_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        model.config.hidden_size // model.config.num_attention_heads) * model.dtype.itemsize * (context + 1024)
    engines = _engines(model, tokenizer, schema, kv_bytes)
    t0 = time.perf_counter()
    engines["host"].encode(SCHEMA + str(context))
    encode_s = time.perf_counter() - t0
    ids = torch.tensor([[t for p in engines["host"].plan(prompt, use_cache=False).pieces for t in p.token_ids]],
                       device=model.device)
    default = str(engines["host"].recovery)

    def cached(pc: PromptCache, recovery: str | None):
        return lambda: pc.generate(prompt, recovery=recovery, max_new_tokens=1)

    @torch.inference_mode()
    def full() -> None:
        model(input_ids=ids, use_cache=False, logits_to_keep=1)

    systems = {
        "full": (full, repeats, 1),
        "full_engine": (lambda: engines["host"].generate(prompt, use_cache=False, max_new_tokens=1), repeats, 1),
        "none_host": (cached(engines["host"], "none"), repeats, 1),
        "none_gpu": (cached(engines["gpu"], "none"), repeats, 1),  # the warm-up promotes the modules
        "default_host": (cached(engines["host"], None), repeats, 1),
        "default_gpu": (cached(engines["gpu"], None), repeats, 1),
        "auto": (cached(engines["auto"], None), repeats, 1),
    }
    s = {name: median(times) for name, times in interleaved(systems, model.device, min_span_s).items()}
    auto = engines["auto"].generate(prompt, max_new_tokens=1)
    row = {
        "context_tokens": k * size, "modules": k, "module_tokens": size, "prompt_tokens": int(ids.shape[1]),
        "recovery": default, "encode_s": encode_s, **{f"{name}_s": v for name, v in s.items()},
        "auto_path": auto.path,
        "speedup_none": ratio(s["full"], s["none_gpu"]), "speedup_none_host": ratio(s["full"], s["none_host"]),
        "speedup_default": ratio(s["full"], s["default_gpu"]), "speedup_default_host": ratio(s["full"], s["default_host"]),
        "speedup_auto": ratio(s["full"], s["auto"]), "speedup_engine_full": ratio(s["full"], s["full_engine"]),
    }
    log(f"shape ttft {row['context_tokens']:>6} tok ({k} x {size}): full {s['full']:.4f} s, engine full "
        f"{s['full_engine']:.4f}, none {s['none_gpu']:.4f} (gpu tier) / {s['none_host']:.4f} (host), {default} "
        f"{s['default_gpu']:.4f} / {s['default_host']:.4f}, auto {s['auto']:.4f} ({auto.path} path): "
        f"{describe(row['speedup_none'], '.1f', 'x')} none, {describe(row['speedup_default'], '.1f', 'x')} {default}")
    return row, (engines["host"], prompt, ids, schema)


def _decode(model, tokenizer, engine: PromptCache, prompt: str, ids: torch.Tensor, schema: str, context: int, n: int,
            repeats: int, left, log, min_span_s: float) -> list[dict[str, object]]:
    lookup0 = PromptCache(model, tokenizer, store=engine.store, fallback="never", prompt_lookup=0, prefix_cache_bytes=0)
    lookup0.add_schema(schema)
    rows = []

    def engine_row(pc: PromptCache, graphs: bool) -> dict[str, object]:
        default = graphs  # the engine's own setting: graphs where they run
        with _graphs_switch(graphs):
            pc.generate(prompt, max_new_tokens=8, ignore_eos=True)  # warm-up: graph capture, buffers
            runs = [pc.generate(prompt, max_new_tokens=n, ignore_eos=True) for _ in range(repeats)]
        decode_s = median([r.total_s - r.ttft_s for r in runs])
        forwards = median([r.num_decode_forwards for r in runs])
        graphs = graphs and graphs_enabled(model.device)  # on CPU every step is eager
        name = "rag-promptcache" + (" (CUDA graphs)" if graphs else " (eager)")
        return {"system": name, "dtype": str(model.dtype).removeprefix("torch."), "prompt_lookup": pc.prompt_lookup,
                "graphs": graphs, "tokens_per_s": ratio(n - 1, decode_s), "tokens_per_forward": (n - 1) / max(forwards, 1),
                "context_tokens": context, "new_tokens": n, "default": default and pc.prompt_lookup == DEFAULT_LOOKUP}

    rows += [engine_row(engine, True), engine_row(lookup0, True), engine_row(lookup0, False)]
    rows.append(_hf_row(model, ids, n, repeats, context, "transformers", static=False, min_span_s=min_span_s))
    if left() > COMPILE_S and model.device.type == "cuda":  # transformers compiles the static-cache step
        rows.append(_hf_row(model, ids, n, repeats, context, "transformers (static cache, compiled)", static=True,
                            min_span_s=min_span_s))
    else:
        log("shape: transformers' static-cache decode not measured (budget spent or not CUDA)")
    for r in rows:
        log(f"shape decode {r['system']:>40} lookup {r['prompt_lookup']}: {describe(r['tokens_per_s'], '.1f', ' tokens/s')}")
    return rows


def _hf_row(model, ids: torch.Tensor, n: int, repeats: int, context: int, name: str, *,
            static: bool, min_span_s: float = 0.0) -> dict[str, object]:
    """transformers' `generate`: its dynamic cache, or (`static`) a fresh `StaticCache` of one length for
    every call, so its compiled step is compiled once."""
    @torch.inference_mode()
    def go(tokens: int) -> float:
        length = ids.shape[1] + max(n, 8) + 1  # the warm-up's 8 tokens included
        cache = cache_arg(model, StaticCache(config=model.config, max_cache_len=length)) if static else {}
        return timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                            min_new_tokens=tokens, do_sample=False, **cache), model.device, min_span_s)[0]

    go(8)  # warm-up (and the compilation of a static-cache step)
    one = median([go(1) for _ in range(repeats)])  # the prefill and the first token
    total = median([go(n) for _ in range(repeats)])
    return {"system": name, "dtype": str(model.dtype).removeprefix("torch."), "prompt_lookup": 0,
            "tokens_per_s": ratio(n - 1, total - one), "tokens_per_forward": 1.0, "context_tokens": context,
            "new_tokens": n, "default": False}


@contextmanager
def _graphs_switch(on: bool) -> Iterator[None]:
    """$RAG_PROMPTCACHE_CUDA_GRAPHS, the user's switch, set around one system's runs."""
    old = os.environ.get(GRAPHS_ENV)
    os.environ[GRAPHS_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(GRAPHS_ENV)
        else:
            os.environ[GRAPHS_ENV] = old


def _write(out: dict[str, object], path: Path | None) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contexts", default="4096,8192,16384,32768")
    parser.add_argument("--tokenizer", default=None, help="a directory holding the default model's tokenizer")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--budget-s", type=float, default=240.0, help="no new context or system starts after this")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    if args.tokenizer:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from rag_promptcache.model.loading import load_tokenizer

        tokenizer = load_tokenizer()
    t0 = time.perf_counter()
    model = random_model(args.shape, args.device)
    print(f"shape: {args.shape} made on {model.device} in {time.perf_counter() - t0:.1f} s")
    run(model, tokenizer, args.shape, contexts, repeats=args.repeats, decode_tokens=args.decode_tokens,
        budget_s=args.budget_s, json_path=args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
