"""Decode speed: tokens per second of the engine's decode loop against transformers' `generate`.

Same RAG prompt for every system (`decode_context` tokens of retrieved modules plus a question, in
the chat template), greedy, exactly `decode_tokens` new tokens (EOS ignored), median of runs,
systems interleaved run by run. Per dtype in `decode_dtypes` (a copy of the model in that dtype):
- `transformers`: `model.generate` on the full token sequence, its default DynamicCache;
- `transformers` with `prompt_lookup: 8`: the same with `prompt_lookup_num_tokens=8`, transformers'
  own prompt lookup decoding (the best plain transformers offers for this; not its default);
- `rag-promptcache`: `PromptCache.generate(..., ignore_eos=True)` with every module cached, with the
  engine's default prompt lookup (engine/decoding/lookup.py); a second row with `prompt_lookup: 0`, the plain
  one-token loop, whose greedy tokens the default row's are compared with (`tokens_match_no_lookup`:
  equal in fp32, while bf16 rounds a multi-token check differently from single steps and may flip a
  near tie).

Decode seconds exclude the first token: for transformers, the time between the first and the last
call of a logits processor (one call per generated token, after each forward; with prompt lookup,
whose candidate generator calls the processors too, from the end of the first forward to the end
of `generate`); for the engine, `total_s - ttft_s`. Every row gives `tokens_per_forward`: new tokens
after the first per decode forward (1.0 without lookup).

With EOS ignored the small model runs on past its answer and soon repeats itself, which prompt
lookup drafts well. So `answers` measures decoding on answers as a user gets them: four questions on
the same documents, the corpus's defaults (no 6-gram of the answer twice, so no verbatim loop),
ended by EOS or 128 tokens; the engine with and without lookup, and transformers in fp32. Warm-up: one short run per system. `end_to_end_s` is the whole call, TTFT included. Rows follow the issue's
contract: `system`, `dtype`, `tokens_per_s`, and `default: true` on the engine's default row; each
also has its ratio to transformers in fp32 (the user's baseline) and in its own dtype. A rate or ratio
whose seconds measured zero (a run shorter than the clock's step) is None, logged as "below the
clock's resolution".

Not here: TTFT against context size (ttft.py), batched throughput (the serve scenario).
"""

from __future__ import annotations

import copy
import math
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedModel

from rag_promptcache.bench import llamacpp
from rag_promptcache.bench.common import QUESTION, Bench, fit_question, interleaved, median, module_texts, schema_pml
from rag_promptcache.engine import PromptCache, Sampling
from rag_promptcache.engine.decoding.sampling import penalize
from rag_promptcache.engine.decoding.lookup import DEFAULT_LOOKUP
from rag_promptcache.model.loading import dtype_name, parse_dtype, resolve_device_dtype
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.store import MemoryStore
from rag_promptcache.timing import describe, ratio

SCHEMA = "bench_decode"
ENGINE = "rag-promptcache"
BASELINE = "transformers"
WARMUP_TOKENS = 8
# about the decode prompt's documents (the pydoc topics "assert" and "assignment"), for `answers`
ANSWER_QUESTIONS = (
    "What does the assert statement do, and when is it removed?",
    "How is an assignment to a target list carried out?",
    "What happens when the target of an assignment is a subscription?",
    "How does an assignment statement evaluate its expression list?",
)


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
    m, schema = _schema(bench)
    prompt = _prompt(bench, m, QUESTION)
    default_dtype = resolve_device_dtype(bench.device, None)[1]
    n = cfg.decode_tokens
    systems: dict[str, tuple] = {}
    results: dict[str, list[tuple[float, float, int]]] = {}  # name → [(decode s, end-to-end s, forwards)]
    meta: dict[str, tuple[str, torch.dtype, int]] = {}  # name → (system, dtype, prompt lookup)
    compare: dict[str, str] = {}  # an engine row → the row whose greedy tokens it is compared with
    tokens: dict[str, tuple[int, ...]] = {}  # name → the greedy tokens of its last run
    for dt in dict.fromkeys(parse_dtype(d) or default_dtype for d in cfg.decode_dtypes):
        model, d = model_in(bench, dt), dtype_name(dt)
        pc = PromptCache(model, tok, name=bench.model_name, **bench.engine_options)
        pc.add_schema(schema)
        pc.encode(SCHEMA)
        plain = PromptCache(model, tok, store=pc.store, name=bench.model_name, prompt_lookup=0, **bench.engine_options)
        plain.add_schema(schema)
        ids = torch.tensor([[t for p in pc.plan(prompt, use_cache=False).pieces for t in p.token_ids]],
                           device=model.device)
        for lookup in (0, DEFAULT_LOOKUP):
            name = f"{BASELINE}/{d}/{lookup}"
            systems[name] = (_hf(model, ids, n, results, name, lookup), cfg.repeats_slow, 0)
            meta[name] = (BASELINE, dt, lookup)
        for engine in (pc, plain):
            name = f"{ENGINE}/{d}/{engine.prompt_lookup}"
            systems[name] = (_engine(engine, prompt, n, results, name, tokens), cfg.repeats_slow, 0)
            meta[name] = (ENGINE, dt, engine.prompt_lookup)
        compare[f"{ENGINE}/{d}/{pc.prompt_lookup}"] = f"{ENGINE}/{d}/0"
        if cfg.warmup:  # a short run warms every kernel and allocation that a long one uses
            _hf(model, ids, WARMUP_TOKENS, {"w": []}, "w", DEFAULT_LOOKUP)()
            for engine in (pc, plain):
                _engine(engine, prompt, WARMUP_TOKENS, {"w": []}, "w")()
        bench.log(f"decode: {d} prompt of {ids.shape[1]} tokens, {n} new tokens")
    for name in systems:
        results[name] = []
    interleaved(systems, bench.device, bench.min_span_s)
    rows = []
    for name, runs in results.items():
        system, dt, lookup = meta[name]
        decode_s = median([r[0] for r in runs])
        rows.append({
            "system": system, "dtype": dtype_name(dt), "prompt_lookup": lookup, "tokens_per_s": ratio(n - 1, decode_s),
            "decode_s": decode_s, "end_to_end_s": median([r[1] for r in runs]), "new_tokens": n,
            "context_tokens": m * cfg.module_tokens, "runs": len(runs),
            "default": system == ENGINE and dt == default_dtype and lookup == DEFAULT_LOOKUP,
        })
        rows[-1]["tokens_per_forward"] = (n - 1) / median([r[2] for r in runs])
        if name in compare:
            rows[-1]["tokens_match_no_lookup"] = tokens.get(name) == tokens.get(compare[name])
    baseline = {r["dtype"]: r["tokens_per_s"] for r in rows if r["system"] == BASELINE and not r["prompt_lookup"]}
    for r in rows:
        # fp32: the user's baseline (transformers loads the default model, a dequantized GGUF, in fp32)
        r["x_transformers_fp32"] = ratio(r["tokens_per_s"], baseline.get("float32", math.nan))
        r["x_transformers_same_dtype"] = ratio(r["tokens_per_s"], baseline[r["dtype"]])
        bench.log(f"decode {r['system']:>15} {r['dtype']:>8} lookup {r['prompt_lookup']}: "
                  f"{describe(r['tokens_per_s'], '.1f', ' tokens/s')} ({describe(r['x_transformers_fp32'], '.2f', 'x')} "
                  f"transformers fp32, {describe(r['x_transformers_same_dtype'], '.2f', 'x')} in {r['dtype']}), "
                  f"end to end {r['end_to_end_s']:.2f} s" + (" [default]" if r["default"] else ""))
    rows += llamacpp.decode_rows(bench, ids[0].tolist(), rows)  # [] where llama.cpp cannot run
    return rows


def answers(bench: Bench) -> dict[str, object]:
    """Decode on answers as a user gets them (see the module docstring): the engine in its default
    dtype with its default lookup and with none, and transformers in fp32 (the user's baseline) with
    the same answer-only no-repeat rule; every question once per round, rounds interleaved."""
    from rag_promptcache.rag.repetition import DEFAULT_NO_REPEAT_NGRAM

    cfg, tok = bench.config, bench.tokenizer
    dt = resolve_device_dtype(bench.device, None)[1]
    model, store = model_in(bench, dt), MemoryStore()
    engines = {lookup: PromptCache(model, tok, store=store, name=bench.model_name, prompt_lookup=lookup,
                                   **bench.engine_options) for lookup in (DEFAULT_LOOKUP, 0)}
    m, schema = _schema(bench)
    prompts = [_prompt(bench, m, q, fit=False) for q in ANSWER_QUESTIONS]
    for pc in engines.values():
        pc.add_schema(schema)
    engines[0].encode(SCHEMA)
    ids = [[t for p in engines[0].plan(prompt, use_cache=False).pieces for t in p.token_ids] for prompt in prompts]
    baseline = model_in(bench, torch.float32)
    Answer = tuple[float, int, int, tuple[int, ...]]  # (decode s, tokens after the first, forwards, token ids)

    def engine(lookup: int) -> list[Answer]:
        out = []
        for prompt in prompts:
            r = engines[lookup].generate(prompt, max_new_tokens=cfg.decode_tokens, no_repeat_ngram=DEFAULT_NO_REPEAT_NGRAM)
            out.append((r.total_s - r.ttft_s, r.num_generated - 1, r.num_decode_forwards, r.token_ids))
        return out

    def transformers() -> list[Answer]:
        out = []
        for prompt_ids in ids:
            clock, rule = _Clock(), _AnswerNoRepeat(len(prompt_ids), DEFAULT_NO_REPEAT_NGRAM)
            x = torch.tensor([prompt_ids], device=baseline.device)
            with torch.inference_mode():
                new = baseline.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.decode_tokens,
                                        do_sample=False, logits_processor=LogitsProcessorList([rule, clock]))[0, x.shape[1]:]
            out.append((clock.stamps[-1] - clock.stamps[0], len(new) - 1, len(new) - 1, tuple(new.tolist())))
        return out

    systems = {(ENGINE, dtype_name(dt), DEFAULT_LOOKUP): lambda: engine(DEFAULT_LOOKUP),
               (ENGINE, dtype_name(dt), 0): lambda: engine(0), (BASELINE, "float32", 0): transformers}
    runs: dict[tuple, list[list[Answer]]] = {key: [] for key in systems}
    if cfg.warmup:
        for fn in systems.values():
            fn()
    interleaved({str(key): (lambda key=key: runs[key].append(systems[key]()), cfg.repeats_slow, 0) for key in systems},
                bench.device, bench.min_span_s)
    rows = []
    for (system, dtype, lookup), rounds in runs.items():
        # the median round by seconds per token; its answers' decode seconds and tokens summed
        _, median_round = sorted((sum(a[0] for a in r) / max(1, sum(a[1] for a in r)), r) for r in rounds)[len(rounds) // 2]
        tokens = sum(a[1] for a in median_round)
        rows.append({"system": system, "dtype": dtype, "prompt_lookup": lookup,
                     "tokens_per_s": ratio(tokens, sum(a[0] for a in median_round)),
                     "tokens_per_forward": tokens / max(1, sum(a[2] for a in median_round)),
                     "answer_tokens": [a[1] + 1 for a in median_round], "rounds": len(rounds),
                     "default": system == ENGINE and lookup == DEFAULT_LOOKUP})
    fast, plain, hf = rows
    for r in rows:
        r["x_transformers_fp32"] = ratio(r["tokens_per_s"], hf["tokens_per_s"])
    same = [a[3] == b[3] for a, b in zip(runs[(ENGINE, dtype_name(dt), DEFAULT_LOOKUP)][-1], runs[(ENGINE, dtype_name(dt), 0)][-1])]
    out = {"dtype": dtype_name(dt), "questions": len(prompts), "rows": rows,
           "lookup_speedup": ratio(fast["tokens_per_s"], plain["tokens_per_s"]), "answers_identical": sum(same)}
    bench.log(f"decode answers: engine {out['dtype']} lookup {DEFAULT_LOOKUP} {describe(fast['tokens_per_s'], '.1f')} "
              f"tokens/s ({fast['tokens_per_forward']:.2f} per forward), lookup 0 {describe(plain['tokens_per_s'], '.1f')}, "
              f"transformers fp32 {describe(hf['tokens_per_s'], '.1f')}: {describe(out['lookup_speedup'], '.2f', 'x')} "
              f"from lookup, {describe(fast['x_transformers_fp32'], '.2f', 'x')} transformers fp32; "
              f"{sum(same)}/{len(same)} answers identical with and without lookup")
    return out


class _AnswerNoRepeat(LogitsProcessor):
    """The engine's `no_repeat_ngram` for transformers: over the answer's tokens only, not the prompt's
    (transformers' own `no_repeat_ngram_size` would forbid copying the documents)."""

    def __init__(self, prompt_tokens: int, n: int) -> None:
        self.prompt_tokens, self.sampling = prompt_tokens, Sampling(no_repeat_ngram=n)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        answer = input_ids[0, self.prompt_tokens :].tolist()
        return penalize(scores[0], self.sampling, answer)[None]


def _schema(bench: Bench) -> tuple[int, str]:
    """(modules, the schema PML): ~decode_context tokens of modules, `module_tokens` each."""
    cfg = bench.config
    m = max(1, cfg.decode_context // cfg.module_tokens)
    texts = module_texts(bench.tokenizer, m, cfg.module_tokens)
    return m, schema_pml(SCHEMA, {f"d{i}": t for i, t in enumerate(texts)})


def _prompt(bench: Bench, m: int, question: str, fit: bool = True) -> str:
    """The prompt PML: all m modules, then `question` (`fit`: cut or padded to 32 tokens, as every
    system's prompt in `run`)."""
    user = fit_question(bench.tokenizer, question, 32) if fit else question
    return prompt_pml(SCHEMA, [f"d{i}" for i in reversed(range(m))], [("user", user)])


def _hf(model: PreTrainedModel, ids: torch.Tensor, n: int, results: dict, name: str, lookup: int = 0):
    options = {"prompt_lookup_num_tokens": lookup} if lookup else {}

    def go() -> None:
        clock = _Clock()
        forwards: list[float] = []  # when each forward of the model ended
        hook = model.register_forward_hook(lambda *_: forwards.append(time.perf_counter()))
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, logits_processor=LogitsProcessorList([clock]), **options)
        finally:
            hook.remove()
        total = time.perf_counter() - t0
        assert out.shape[1] - ids.shape[1] == n, f"{out.shape=} {ids.shape=} {n=}"
        # with lookup, the candidate generator calls the processors too (before any forward): from
        # the end of the first forward (the prefill) to the end of `generate`
        decode_s = t0 + total - forwards[0] if lookup else clock.stamps[-1] - clock.stamps[0]
        results[name].append((decode_s, total, len(forwards) - 1))
    return go


def _engine(pc: PromptCache, prompt: str, n: int, results: dict, name: str, tokens: dict | None = None):
    def go() -> None:
        res = pc.generate(prompt, max_new_tokens=n, ignore_eos=True)
        assert len(res.token_ids) == n and not res.missed_modules, f"{len(res.token_ids)=} {res.missed_modules=}"
        results[name].append((res.total_s - res.ttft_s, res.total_s, res.num_decode_forwards))
        if tokens is not None:
            tokens[name] = res.token_ids
    return go
