"""Decode speed: tokens per second of the engine's decode loop against transformers' `generate`.

Same RAG prompt for every system (`decode_context` tokens of retrieved modules plus a question, in
the chat template), greedy, exactly `decode_tokens` new tokens (EOS ignored), median of runs,
systems interleaved run by run. Per dtype in `decode_dtypes` (a copy of the model in that dtype):
- `transformers`: `model.generate` on the full token sequence, its default DynamicCache;
- `rag-promptcache`: `PromptCache.generate(..., ignore_eos=True)` with every module cached, with the
  engine's default decode step (eager unless RAG_PROMPTCACHE_COMPILE is set);
- `rag-promptcache-compiled` (unless `decode_compile` is "off" or the default already compiles): the
  same with the compiled static decode step (engine/static_decode.py) in mode `decode_compile`; its
  graph is compiled before the timed runs (`compile_s`: that warm-up, which the FX graph cache in
  ~/.cache or TORCHINDUCTOR_CACHE_DIR shortens in a later process) and its greedy tokens are
  compared with the eager row's (`tokens_match_eager`).

Decode seconds exclude the first token: for transformers, the time between the first and the last
call of a logits processor (one call per generated token, after each forward); for the engine,
`total_s - ttft_s`. Warm-up: one short run per system. `end_to_end_s` is the whole call, TTFT included. Rows follow the issue's
contract: `system`, `dtype`, `tokens_per_s`, and `default: true` on the engine's default row; each
also has its ratio to transformers in fp32 (the user's baseline) and in its own dtype.

Not here: TTFT against context size (ttft.py), batched throughput (the serve scenario).
"""

from __future__ import annotations

import copy
import math
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from rag_promptcache.bench.common import QUESTION, Bench, fit_question, interleaved, median, module_texts, schema_pml
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.static_decode import compile_mode
from rag_promptcache.model.loading import dtype_name, parse_dtype, resolve_device_dtype
from rag_promptcache.pml.build import prompt_pml

SCHEMA = "bench_decode"
ENGINE = "rag-promptcache"
BASELINE = "transformers"
COMPILED = "rag-promptcache-compiled"
WARMUP_TOKENS = 8


class _Clock(LogitsProcessor):
    """Records when each generated token's logits arrive; changes nothing."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        return scores


def model_in(bench: Bench, dtype: torch.dtype) -> PreTrainedModel:
    """The bench's model, or a copy of it in `dtype` (kept in bench.extras for later scenarios)."""
    if bench.model.dtype == dtype:
        return bench.model
    key = f"model_{dtype_name(dtype)}"
    if key not in bench.extras:
        bench.extras[key] = copy.deepcopy(bench.model).to(dtype).eval()
    return bench.extras[key]  # type: ignore[return-value]


def run(bench: Bench) -> list[dict[str, object]]:
    cfg, tok = bench.config, bench.tokenizer
    m = max(1, cfg.decode_context // cfg.module_tokens)
    texts = module_texts(tok, m, cfg.module_tokens)
    schema = schema_pml(SCHEMA, {f"d{i}": t for i, t in enumerate(texts)})
    prompt = prompt_pml(SCHEMA, [f"d{i}" for i in reversed(range(m))], [("user", fit_question(tok, QUESTION, 32))])
    default_dtype = resolve_device_dtype(bench.device, None)[1]
    n = cfg.decode_tokens
    systems: dict[str, tuple] = {}
    results: dict[str, list[tuple[float, float]]] = {}  # name → [(decode s, end-to-end s)]
    meta: dict[str, tuple[str, torch.dtype]] = {}
    extra: dict[str, dict[str, object]] = {}  # name → fields of the compiled rows
    tokens: dict[str, tuple[int, ...]] = {}  # name → the greedy tokens of its last run
    compiled = None if compile_mode(None) is not None or cfg.decode_compile == "off" else compile_mode(cfg.decode_compile)
    for dt in dict.fromkeys(parse_dtype(d) or default_dtype for d in cfg.decode_dtypes):
        model = model_in(bench, dt)
        pc = PromptCache(model, tok, name=bench.model_name, **bench.engine_options)
        pc.add_schema(schema)
        pc.encode(SCHEMA)
        ids = torch.tensor([[t for p in pc.plan(prompt, use_cache=False).pieces for t in p.token_ids]],
                           device=model.device)
        systems[f"{BASELINE}/{dtype_name(dt)}"] = (_hf(model, ids, n, results, f"{BASELINE}/{dtype_name(dt)}"),
                                                   cfg.repeats_slow, 0)
        systems[f"{ENGINE}/{dtype_name(dt)}"] = (_engine(pc, prompt, n, results, f"{ENGINE}/{dtype_name(dt)}", tokens),
                                                 cfg.repeats_slow, 0)
        extra[f"{ENGINE}/{dtype_name(dt)}"] = {"decoder": pc.decoder}
        if cfg.warmup:  # a short run warms every kernel and allocation that a long one uses
            _hf(model, ids, WARMUP_TOKENS, {"w": []}, "w")()
            _engine(pc, prompt, WARMUP_TOKENS, {"w": []}, "w")()
        meta[f"{BASELINE}/{dtype_name(dt)}"] = (BASELINE, dt)
        meta[f"{ENGINE}/{dtype_name(dt)}"] = (ENGINE, dt)
        fast = None if compiled is None else PromptCache(model, tok, store=pc.store, name=bench.model_name,
                                                         compile=compiled, **bench.engine_options)
        if fast is not None and fast.decoder is None:
            bench.log(f"decode: no compiled row, {type(model).__name__} has no static decode step")
        elif fast is not None:
            fast.add_schema(schema)
            name = f"{COMPILED}/{dtype_name(dt)}"
            compile_s = fast.warm_decode(ids.shape[1] + n)  # as Corpus.prepare does: before any question
            systems[name] = (_engine(fast, prompt, n, results, name, tokens), cfg.repeats_slow, 0)
            if cfg.warmup:
                _engine(fast, prompt, WARMUP_TOKENS, {"w": []}, "w")()
            meta[name] = (COMPILED, dt)
            extra[name] = {"decoder": fast.decoder, "compile_s": compile_s, "eager_row": f"{ENGINE}/{dtype_name(dt)}"}
        bench.log(f"decode: {dtype_name(dt)} prompt of {ids.shape[1]} tokens, {n} new tokens")
    for name in systems:
        results[name] = []
    interleaved(systems, bench.device)
    rows = []
    for name, runs in results.items():
        system, dt = meta[name]
        decode_s = median([d for d, _ in runs])
        rows.append({
            "system": system, "dtype": dtype_name(dt), "tokens_per_s": (n - 1) / decode_s,
            "decode_s": decode_s, "end_to_end_s": median([e for _, e in runs]), "new_tokens": n,
            "context_tokens": m * cfg.module_tokens, "runs": len(runs),
            "default": system == ENGINE and dt == default_dtype,
        })
        if name in extra:  # the engine's rows: how their decode step ran
            fields = dict(extra[name])
            decoder, eager_row = fields.pop("decoder"), fields.pop("eager_row", None)
            rows[-1]["compile"] = decoder.mode if decoder is not None else "off"
            if decoder is not None:
                rows[-1].update(graphs=len(decoder.capacities), compile_error=decoder.error)
            if eager_row is not None:
                rows[-1]["tokens_match_eager"] = tokens.get(name) == tokens.get(str(eager_row))
            rows[-1].update(fields)
    baseline = {r["dtype"]: r["tokens_per_s"] for r in rows if r["system"] == BASELINE}
    for r in rows:
        # fp32: the user's baseline (transformers loads the default model, a dequantized GGUF, in fp32)
        r["x_transformers_fp32"] = r["tokens_per_s"] / baseline.get("float32", math.nan)
        r["x_transformers_same_dtype"] = r["tokens_per_s"] / baseline[r["dtype"]]
        bench.log(f"decode {r['system']:>15} {r['dtype']:>8}: {r['tokens_per_s']:.1f} tokens/s "
                  f"({r['x_transformers_fp32']:.2f}x transformers fp32, {r['x_transformers_same_dtype']:.2f}x in "
                  f"{r['dtype']}), end to end {r['end_to_end_s']:.2f} s" + (" [default]" if r["default"] else ""))
    return rows


def _hf(model: PreTrainedModel, ids: torch.Tensor, n: int, results: dict, name: str):
    def go() -> None:
        clock = _Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, logits_processor=LogitsProcessorList([clock]))
        total = time.perf_counter() - t0
        assert out.shape[1] - ids.shape[1] == n, f"{out.shape=} {ids.shape=} {n=}"
        results[name].append((clock.stamps[-1] - clock.stamps[0], total))
    return go


def _engine(pc: PromptCache, prompt: str, n: int, results: dict, name: str, tokens: dict | None = None):
    def go() -> None:
        res = pc.generate(prompt, max_new_tokens=n, ignore_eos=True)
        assert len(res.token_ids) == n and not res.missed_modules, f"{len(res.token_ids)=} {res.missed_modules=}"
        results[name].append((res.total_s - res.ttft_s, res.total_s))
        if tokens is not None:
            tokens[name] = res.token_ids
    return go
