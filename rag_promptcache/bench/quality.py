"""Quality of cached assembly against full prefill of the same tokens, per mode, recovery and codec.

The corpus is the demo's: the first (up to) 256 tokens of each demo topic of the Python reference
are the modules. Question i is about topic i (its title made into a question); its k modules are
that topic's chunk plus k-1 seeded random distractors, in a seeded random order, the way retrieval
returns a relevant chunk among others. Per question:

- full prefill once (shared by every configuration): first-token distribution, then a greedy
  continuation of `continuation` tokens, which is the reference; its NLL under full prefill comes
  from the same decode steps;
- per configuration: plan (with recovery), assemble, prefill the new tokens → first-token top-1 and
  KL(full || cached); then the reference continuation teacher-forced in one forward → its NLL, and
  greedy exact match (the cached greedy continuation equals the reference iff every teacher-forced
  argmax equals the reference token, by induction over the steps).

`ttft_s` per row is the median time from plan to first-token logits (the Pareto plot's x axis).
Not here: TTFT against context size (ttft.py).
"""

from __future__ import annotations

import random
import time

import torch

from rag_promptcache.bench.common import Bench, median, schema_pml, sync, windows
from rag_promptcache.engine import DEFAULT_MODE, PromptCache
from rag_promptcache.engine.kv.assemble import assemble
from rag_promptcache.engine.compute.runner import cache_arg, forward_last, output_cache
from rag_promptcache.engine.decoding.sampling import eos_token_ids
from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.rag.sample import TOPICS, topic_texts
from rag_promptcache.store import MemoryStore
from rag_promptcache.timing import ratio

SCHEMA = "bench_quality"
TEMPLATES = (
    "What does the Python language reference say about {t}? Answer briefly.",
    "How does {t} work in Python, according to the documents?",
    "Explain {t} in Python in two sentences.",
    "What are the rules for {t} in Python?",
)


def engine_defaults() -> tuple[str, str]:
    """(mode, recovery) a PromptCache uses when not told otherwise."""
    return DEFAULT_MODE, _canonical(DEFAULT_RECOVERY)


def _canonical(spec: str) -> str:
    return str(Recovery.parse(spec))


def _budget(spec: str) -> float:
    kind, _, rest = spec.partition(":")
    return float(rest.partition("@")[0]) if rest else 0.0


def questions(bench: Bench) -> tuple[dict[str, str], list[tuple[str, str, list[str]]]]:
    """→ (modules by name, [(topic, question, module names)]) for the largest k."""
    tok, cfg = bench.tokenizer, bench.config
    modules: dict[str, str] = {}
    topics: list[str] = []
    for topic, text in topic_texts(TOPICS).items():
        chunk = windows(tok, text, cfg.module_tokens, limit=1, exact=False)
        if chunk:
            modules[f"t{len(modules)}"] = chunk[0]
            topics.append(topic)
    k = max(cfg.ks)
    assert len(modules) >= k, f"{len(modules)=} {k=}"
    names = list(modules)
    out = []
    for i in range(cfg.questions):
        j = i % len(names)
        rng = random.Random(i)
        picked = [names[j]] + rng.sample([n for n in names if n != names[j]], k - 1)
        out.append((topics[j], TEMPLATES[i % len(TEMPLATES)].format(t=topics[j].replace("-", " ")), picked))
    return modules, out


@torch.inference_mode()
def run(bench: Bench) -> list[dict[str, object]]:
    cfg, model, tok = bench.config, bench.model, bench.tokenizer
    modules, qs = questions(bench)
    schema = schema_pml(SCHEMA, modules)
    configs = list(cfg.quality_configs)
    default_mode, default_recovery = engine_defaults()
    eos = eos_token_ids(model, tok)

    stores: dict[str, MemoryStore] = {}  # native KV per mode, encoded once
    for mode in dict.fromkeys([m for m, _ in configs] + [default_mode]):
        pc = PromptCache(model, tok, store=MemoryStore(), mode=mode, name=bench.model_name, prefix_cache_bytes=0)
        pc.add_schema(schema)
        report = pc.encode(SCHEMA)
        bench.extras.setdefault("quality_encode", {})[mode] = report
        bench.log(f"quality: encoded {report.num_modules} modules ({report.num_tokens} tokens, {mode}) "
                  f"in {report.seconds:.1f} s")
        stores[mode] = pc.store
    bench.extras["quality_stores"] = stores

    runs = [(mode, rec, "native", k) for k in cfg.ks for mode, rec in configs]
    runs += [(default_mode, default_recovery, c, cfg.codec_k) for c in cfg.codecs if c != "native"]
    rows = []
    refs: dict[tuple[int, int], _Reference] = {}
    for k in dict.fromkeys(k for _, _, _, k in runs):  # full prefill first: the cached timings follow no cold start
        pc = PromptCache(model, tok, store=stores[default_mode], mode=default_mode, name=bench.model_name, prefix_cache_bytes=0)
        pc.add_schema(schema)
        for qi, (_, question, picked) in enumerate(qs):
            refs[(qi, k)] = _reference(pc, prompt_pml(SCHEMA, picked[:k], [("user", question)]), cfg.continuation, eos)
    for mode, rec, codec, k in runs:
        store = stores[mode] if codec == "native" else _recoded(stores[mode], codec)
        pc = PromptCache(model, tok, store=store, mode=mode, name=bench.model_name, prefix_cache_bytes=0)
        pc.add_schema(schema)
        prompts = [prompt_pml(SCHEMA, picked[:k], [("user", question)]) for _, question, picked in qs]
        _cached(pc, prompts[0], rec, refs[(0, k)])  # warm-up
        per_q = [_cached(pc, p, rec, refs[(qi, k)]) for qi, p in enumerate(prompts)]
        rows.append(_row(mode, rec, codec, k, per_q, [refs[(qi, k)] for qi in range(len(qs))],
                         default=(mode, _canonical(rec), codec) == (default_mode, default_recovery, "native")))
        r = rows[-1]
        bench.log(f"quality k={k} {mode}/{rec}/{codec}: top-1 {r['top1_agreement']:.2f}, KL {r['mean_kl']:.4f}, "
                  f"exact {r['greedy_exact_match']:.2f}, NLL {r['nll_full']:.3f}→{r['nll_cached']:.3f}, "
                  f"TTFT {r['ttft_s']:.3f} s (full {r['full_ttft_s']:.3f})")
    return rows


def _recoded(native: MemoryStore, codec: str) -> MemoryStore:
    out = MemoryStore(codec=codec)
    for key in native.keys():
        out.put(key, native.get(key))
    return out


class _Reference:
    __slots__ = ("ids", "logits", "tokens", "nll", "seconds")

    def __init__(self, ids: torch.Tensor, logits: torch.Tensor, tokens: list[int], nll: float, seconds: float):
        self.ids, self.logits, self.tokens, self.nll, self.seconds = ids, logits, tokens, nll, seconds


def _reference(pc: PromptCache, prompt: str, num_tokens: int, eos: frozenset[int]) -> _Reference:
    """Full prefill of the prompt's tokens, then a greedy continuation: the reference."""
    model, device = pc.model, pc.model.device
    ids = torch.tensor([[t for p in pc.plan(prompt, use_cache=False).pieces for t in p.token_ids]], device=device)
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    first = out.logits[0, -1].float()
    int(first.argmax())
    seconds = time.perf_counter() - t0
    cache, logits, tokens, nll = output_cache(out), first, [], []
    for i in range(num_tokens):
        lp = logits.log_softmax(-1)
        token = int(lp.argmax())
        tokens.append(token)
        nll.append(float(-lp[token]))
        if token in eos or i == num_tokens - 1:
            break
        logits = forward_last(model, torch.tensor([[token]], device=device),
                              torch.tensor([[ids.shape[1] + i]], device=device), cache)
    return _Reference(ids, first.cpu(), tokens, sum(nll) / len(nll), seconds)


def _cached(pc: PromptCache, prompt: str, recovery: str | None, ref: _Reference) -> dict[str, float]:
    model, device = pc.model, pc.model.device
    sync(device)
    t0 = time.perf_counter()
    plan = pc.plan(prompt) if recovery is None else pc.plan(prompt, recovery=recovery)
    asm = assemble(plan.pieces, plan.kvs, pc.relocator, model.config, pc.geometry, device, model.dtype,
                   extra=len(ref.tokens))  # room for the continuation, as generate reserves it
    first = forward_last(model, asm.new_ids, asm.new_positions, asm.cache, asm.mask)
    int(first.argmax())
    seconds = time.perf_counter() - t0
    assert plan.num_tokens == ref.ids.shape[1], f"{plan.num_tokens=} {ref.ids.shape=}"
    lp_full, lp = ref.logits.log_softmax(-1), first.cpu().log_softmax(-1)
    kl = float((lp_full.exp() * (lp_full - lp)).sum())
    steps = [lp]
    if len(ref.tokens) > 1:
        start = max(p.position + len(p.token_ids) for p in plan.pieces)
        forced = torch.tensor([ref.tokens[:-1]], device=device)
        pos = torch.arange(start, start + forced.shape[1], device=device)[None]
        out = model(input_ids=forced, position_ids=pos, use_cache=True, **cache_arg(model, asm.cache))
        steps += list(out.logits[0].float().cpu().log_softmax(-1))
    nll = sum(float(-s[t]) for s, t in zip(steps, ref.tokens)) / len(ref.tokens)
    return {
        "top1": float(int(lp.argmax()) == int(lp_full.argmax())),
        "kl": kl,
        "exact": float(all(int(s.argmax()) == t for s, t in zip(steps, ref.tokens))),
        "nll": nll,
        "seconds": seconds,
        "new_tokens": float(asm.new_ids.shape[1]),
        "cached_tokens": float(asm.num_cached),
    }


def _row(mode: str, rec: str, codec: str, k: int, per_q: list[dict[str, float]], refs: list[_Reference],
         default: bool) -> dict[str, object]:
    mean = lambda key: sum(q[key] for q in per_q) / len(per_q)  # noqa: E731
    nll_full = sum(r.nll for r in refs) / len(refs)
    ttft, full = median([q["seconds"] for q in per_q]), median([r.seconds for r in refs])
    return {
        "mode": mode, "codec": codec, "recovery": rec, "budget": _budget(rec), "questions": len(per_q), "k": k,
        "top1_agreement": mean("top1"), "mean_kl": mean("kl"),
        "max_kl": max(q["kl"] for q in per_q),
        "greedy_exact_match": mean("exact"),
        "nll_full": nll_full, "nll_cached": mean("nll"),
        "nll_rel_change": (mean("nll") - nll_full) / nll_full if nll_full else 0.0,
        "default": default,
        "ttft_s": ttft, "full_ttft_s": full, "speedup": ratio(full, ttft),
        "new_tokens": mean("new_tokens"), "cached_tokens": mean("cached_tokens"),
        "continuation_tokens": sum(len(r.tokens) for r in refs) / len(refs),
    }
