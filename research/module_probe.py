"""Probe: cheaper ways to let the module nearest the question read the others (docs/FIDELITY.md, "Making
the one recomputed module cheaper").

`last:1` keeps the answers because the best-ranked module, placed next to the question, is recomputed
whole against the others' cached KV. This probe answers the fidelity splits' questions with settings that
give that module some of the same for fewer FLOPs, beside `none`, `last:1` and `last:2` run through the
engine, judged against the base model's full prefill (`--reference`) and timed against this model's own
full prefill, per question back to back, as `python -m benchmarks.fidelity` does:

- `upper:L`: the nearest module recomputed from layer L up only. Below L the question reads its stored
  KV; at L its tokens enter the forward with the hidden state they had there when the module was encoded
  on its own (what ingest would store beside the KV: 2 bytes x hidden size a token, ~5% of the default
  model's KV), and from there on they attend to the other modules as new tokens do. The prefill is
  the engine's own lean forward, run layer by layer, so the time is what an engine path would cost.
- `tail:T`: the last T tokens of the nearest module recomputed (every layer), the rest read as stored:
  the engine's own split of pieces and prefill.
- `nbr:M+S`: setting S over modules encoded each after its M nearest look-alikes in the corpus (the
  corpus's own retrieval of the module's text, most similar next to it), keeping only the module's KV,
  relocated back to its usual place: zero question-time cost, M+1 times the encoding at ingest.

    python -m research.module_probe --split bench --k 4 8 12 --settings none,last:1,upper:15,tail:64 \
        --reference docs/bench/fidelity-quiet-2026-11-25/tokens32/fidelity.json --out out/probe

Writes fidelity.json / fidelity.md / fidelity_front.png in the fidelity scenario's format (so
`python -m benchmarks.fidelity --pool` pools its runs). Out of scope: storing hidden states
(the probe recomputes them once per module and keeps them in memory, untimed, as a store would hold them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import fidelity as fidelity_runner
from rag_promptcache.bench import fidelity as bench_fidelity
from rag_promptcache.bench import fidelity_reference
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.compute import attention
from rag_promptcache.engine.compute.runner import lean_forward
from rag_promptcache.engine.decoding.decode import can_crop, decode
from rag_promptcache.engine.decoding.sampling import Sampling
from rag_promptcache.engine.kv.assemble import mask_rows, release
from rag_promptcache.engine.planning.plan import Plan
from rag_promptcache.engine.planning.prefill import start
from rag_promptcache.engine.planning.recovery import split
from rag_promptcache.engine.prompt.compiler import ROOT, Unit
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import EvalQuestion, Outcome, Reference, references, summarize
from rag_promptcache.store import MemoryStore
from rag_promptcache.store.base import ModuleKV


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    base: str  # "none", "last:N", "upper:L", "tail:T"
    neighbours: int = 0

    @classmethod
    def parse(cls, spec: str) -> Setting:
        spec = spec.strip()
        nbr, _, rest = spec.partition("+") if spec.startswith("nbr:") else ("", "", spec)
        kind = rest.partition(":")[0]
        if kind not in ("none", "last", "upper", "tail"):
            raise ValueError(f"unknown probe setting {spec!r}; valid: none, last:N, upper:L, tail:T, nbr:M+<one of those>")
        return cls(spec, rest, int(nbr.partition(":")[2]) if nbr else 0)

    @property
    def arg(self) -> int:
        return int(self.base.partition(":")[2] or 0)


class Modules:
    """Each module's stored form as a probe setting wants it: its KV (encoded alone, or after its
    neighbours) and its hidden states per layer input, made once and kept."""

    def __init__(self, engine: PromptCache, corpus: Corpus) -> None:
        self.engine, self.corpus = engine, corpus
        self._units: dict[str, Unit] = {}
        self._made: dict[tuple[str, int], tuple[ModuleKV, torch.Tensor]] = {}

    def unit(self, module_id: str) -> Unit:
        if module_id not in self._units:
            prompt = self.corpus.prompt("?", [module_id])
            planner = self.engine.planner
            self._units[module_id] = planner.schemas.compile_prompt(prompt, planner.config.layout).schema.units[module_id]
        return self._units[module_id]

    def neighbours(self, module_id: str, m: int) -> list[str]:
        """The m modules nearest to this one's text (the corpus's retrieval), least similar first."""
        text = self.corpus.table.module(module_id)[0]
        found = [n for n, _ in self.corpus.search(text, m + 1) if n != module_id][:m]
        return found[::-1]

    @torch.inference_mode()
    def stored(self, module_id: str, m: int) -> tuple[ModuleKV, torch.Tensor]:
        """(KV at the unit's own encode start, hidden states [layers + 1, tokens, hidden]: index i is layer
        i's input) of the module encoded after its shared prefix and its m nearest neighbours."""
        key = (module_id, m)
        if key in self._made:
            return self._made[key]
        unit = self.unit(module_id)
        before = [t for n in self.neighbours(module_id, m) for t in self.unit(n).token_ids] if m else []
        context = list(unit.context_ids)
        ids = context + before + list(unit.token_ids)
        start_at = unit.encode_start - len(context)  # the context's own first position
        model = self.engine.model
        positions = torch.arange(start_at, start_at + len(ids))[None]
        out = model.model(input_ids=torch.tensor([ids]), position_ids=positions, use_cache=True,
                          output_hidden_states=True)
        n = len(unit.token_ids)
        keys = torch.stack([layer.keys[0, :, -n:] for layer in out.past_key_values.layers])  # [L, H, n, D]
        values = torch.stack([layer.values[0, :, -n:] for layer in out.past_key_values.layers])
        if before:  # encoded len(before) positions later than the unit's own start: move it back
            keys = self.engine.relocator.rotate(keys, torch.full((n,), -len(before)))
        hidden = torch.stack([h[0, -n:] for h in out.hidden_states])  # [L + 1, n, E]
        kv = ModuleKV(keys.contiguous(), values.contiguous(), unit.encode_start, unit.token_ids,
                      self.engine.fingerprint, self.engine.mode)
        self._made[key] = (kv, hidden)
        return self._made[key]


def _nearest(plan: Plan) -> str:
    """The module next to the question: the last cached module piece's."""
    return [p.unit for p in plan.pieces if p.cached and p.unit != ROOT][-1]


def _with_kvs(plan: Plan, modules: Modules, m: int) -> Plan:
    if not m:
        return plan
    return dataclasses.replace(plan, kvs={n: (kv if n == ROOT else modules.stored(n, m)[0]) for n, kv in plan.kvs.items()})


def _tail(plan: Plan, t: int) -> Plan:
    """The plan with the last t tokens of the nearest module turned into new tokens."""
    name, seq, chosen = _nearest(plan), 0, set()
    spans = []
    for p in plan.pieces:
        if p.cached and p.unit == name:
            spans.extend(range(seq, seq + len(p.token_ids)))
        seq += len(p.token_ids)
    chosen = set(spans[-t:]) if t else set()
    return dataclasses.replace(plan, pieces=tuple(split(plan.pieces, chosen)))


@torch.inference_mode()
def _upper_prefill(engine: PromptCache, plan: Plan, layer: int, stored: tuple[ModuleKV, torch.Tensor], room: int):
    """Prefill `plan` (its nearest module as new tokens, `last:1`'s plan) with that module's tokens joining
    the forward at `layer`: below it, their stored KV relocated into the cache and only the other new tokens
    run; from it, their stored hidden state enters beside the others' → (cache, logits [V])."""
    model = engine.model
    lean = lean_forward(model)
    assert lean is not None, "upper:L needs the lean Llama forward"
    todo = start(model, plan, engine.relocator, engine.geometry, room)
    asm = todo.asm
    kv, hidden = stored
    n_mod = kv.num_tokens
    c, n = asm.num_cached, asm.new_ids.shape[1]
    position = int(asm.new_positions[0, 0])
    assert asm.new_ids[0, :n_mod].tolist() == list(kv.token_ids), "the module's tokens must open the new ones"
    keys = engine.relocator.rotate(kv.keys, torch.full((n_mod,), position - kv.start))
    layers = asm.cache.layers
    for i in range(layer):  # below `layer`: the stored module KV, in the slots the new tokens start at
        layers[i].update(keys[i][None].to(model.dtype), kv.values[i][None].to(model.dtype))
    lean.refresh()
    dtype, device = model.dtype, model.device
    fused_ok = attention.available(dtype, device)

    def run(x, lo, ids_from, num_cached, layer_range):
        pos = asm.new_positions[:, ids_from:]
        cos, sin = lean.rotary(x, pos)
        mask = None if asm.mask is None else mask_rows(asm.mask, ids_from, n, c + n)
        assert not isinstance(mask, dict), "one mask for every layer: Llama has no sliding layers"
        visible = attention.visible_prefixes(mask, num_cached) if (fused_ok and mask is not None) else None
        fused = fused_ok and (mask is None or visible is not None)
        attn_mask = None if fused else lean._mask(mask, x.shape[1], num_cached, dtype, device)
        for i in layer_range:
            x = lean._layer(i, lean.layers[i], x, cos, sin, layers[i], attn_mask, (visible, mask) if fused else None)
        return x

    x = lean.embed(asm.new_ids[:, n_mod:])
    if layer > 0:
        x = run(x, layer, n_mod, c + n_mod, range(layer))
    x = torch.cat([hidden[layer][None].to(dtype), x], dim=1)
    if layer < len(lean.layers):
        x = run(x, layer, 0, c, range(layer, len(lean.layers)))
    logits = lean.head(lean.norm(x[:, -1:]))[0][0].float()
    return asm.cache, logits


def answer(engine: PromptCache, modules: Modules, ref: Reference, setting: Setting, new_tokens: int) -> Outcome:
    sampling = Sampling(max_new_tokens=new_tokens, stop=bench_fidelity.STOP)
    kind = setting.base.partition(":")[0]
    t0 = time.perf_counter()
    if kind in ("none", "last") and not setting.neighbours:
        res = engine.generate(ref.prompt, recovery=setting.base, max_new_tokens=new_tokens, stop=bench_fidelity.STOP)
        text, ttft = res.text, res.ttft_s
    elif kind in ("none", "last", "tail"):
        plan = engine.plan(ref.prompt, recovery=setting.base if kind != "tail" else "none")
        plan = _with_kvs(plan, modules, setting.neighbours)
        if kind == "tail":
            plan = _tail(plan, setting.arg)
        res = engine.stream_plan(plan, sampling, t0=t0).consume()
        text, ttft = res.text, res.ttft_s
    else:  # upper:L
        plan = engine.plan(ref.prompt, recovery="last:1")
        name = [n for n in plan.kvs if n != ROOT][-1]  # the plan's modules in sequence order: the nearest is last
        hidden = modules.stored(name, setting.neighbours)[1]
        plan = _with_kvs(plan, modules, setting.neighbours)
        stored = (plan.kvs[name], hidden)  # below L, the KV the store holds (the engine's own encoding)
        cache, logits = _upper_prefill(engine, plan, setting.arg, stored, new_tokens)
        state = engine.decode_state(plan, sampling, t0=t0, lookup=can_crop(cache))
        try:
            state.advance(logits[None])
            ttft = state.ttft_s
            for _ in decode(engine.model, cache, state, lock=engine.model_lock):
                pass
        finally:
            release(cache)
        text = state.text.text
    right = ref.question.judge(text)
    return Outcome(setting.name, text, right, text.strip() == ref.text.strip(), ttft)


def flops_share(setting: Setting, ref: Reference, modules: Modules, engine: PromptCache, num_layers: int) -> float:
    """Module tokens recomputed, weighted by the share of layers they run through, over the context tokens."""
    kind, arg = setting.base.partition(":")[0], setting.arg
    if kind == "none":
        return 0.0
    plan = engine.plan(ref.prompt, recovery="none")
    names = [p.unit for p in plan.pieces if p.cached and p.unit != ROOT]
    names = list(dict.fromkeys(names))
    size = lambda n: len(modules.unit(n).token_ids)  # noqa: E731
    if kind == "last":
        tokens = sum(size(n) for n in names[-arg:])
    elif kind == "tail":
        tokens = min(arg, size(names[-1]))
    else:
        tokens = size(names[-1]) * (num_layers - arg) / num_layers
    return tokens / max(1, ref.context_tokens)


def run_split(engine: PromptCache, split: str, cfg: argparse.Namespace, settings: list[Setting],
              reference: fidelity_reference.ReferenceRun | None, log) -> list[dict[str, object]]:
    data, chunk = bench_fidelity.split_data(split, 6, cfg.seed_offset)
    questions = [EvalQuestion(q.question, (q.answer,)) for q in data.questions[: cfg.questions]]
    adapter = fidelity_reference.adapter_label(engine.model)
    rows = []
    with tempfile.TemporaryDirectory(prefix="rpc-probe-") as tmp:
        corpus = Corpus.build(data.documents, f"{tmp}/corpus", engine=engine, chunk_tokens=chunk, progress=False)
        corpus.prepare()
        modules = Modules(engine, corpus)
        num_layers = engine.model.config.num_hidden_layers
        log(f"{split}: {len(data.documents)} documents, {len(corpus)} modules")
        warm = references(corpus, questions[:1], cfg.k[0], 1, retrieval="dense")[0]
        for s in settings:  # every path once, and every module's stored forms made, before anything is timed
            answer(engine, modules, warm, s, 1)
        for k in cfg.k:
            refs = references(corpus, questions, k, cfg.new_tokens, bench_fidelity.STOP, "dense")
            for r in refs:  # stored forms are made at ingest: not timed
                for s in settings:
                    if s.neighbours or s.base.startswith("upper"):
                        for m in r.module_ids:
                            modules.stored(m, s.neighbours)
            outcomes: dict[str, list[Outcome]] = {s.name: [] for s in settings}
            timed = []
            for r in refs:  # full prefill again, back to back with every setting: the speed-up's baseline
                full = engine.generate(r.prompt, use_cache=False, max_new_tokens=1).ttft_s
                timed.append(dataclasses.replace(r, ttft_s=full))
                for s in settings:
                    outcomes[s.name].append(answer(engine, modules, r, s, cfg.new_tokens))
            for s in settings:
                report = summarize(s.name, k, timed, outcomes[s.name])
                share = sum(flops_share(s, r, modules, engine, num_layers) * r.context_tokens for r in refs) / max(
                    1, sum(r.context_tokens for r in refs))
                row = fidelity_reference.row(split, adapter, "shared_prefix", "native", report, reference,
                                             recomputed_share=share)
                rows.append(row)
                log(f"{split} k={k} {s.name}: full {row['full_correct']}/{row['with_answer']}"
                    + (f" (reference {row['reference_full_correct']})" if reference else "")
                    + f", cached {row['cached_correct']}, retained {row['retained']:.2f}, kept {row['kept']:.2f},"
                    f" share {share:.3f}, speed-up {row['speedup']:.1f}x")
        corpus.close()
    return rows


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=("bench", "heldout", "manuals", "both"), default="both")
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 12])
    ap.add_argument("--settings", default="none,last:1,upper:15,tail:64")
    ap.add_argument("--questions", type=int, default=42)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--adapter", default="default")
    ap.add_argument("--reference", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    cfg = ap.parse_args(argv)
    settings = [Setting.parse(s) for s in cfg.settings.split(",") if s.strip()]
    splits = ("bench", "heldout") if cfg.split == "both" else (cfg.split,)
    reference = fidelity_reference.load(cfg.reference) if cfg.reference else None
    torch.set_num_threads(cfg.threads)
    from rag_promptcache.model.loading import load_model

    model, tok = load_model("smollm2-135m-instruct", dtype=cfg.dtype, adapter=cfg.adapter)
    engine = PromptCache(model, tok, store=MemoryStore(), name="smollm2-135m-instruct", **bench_fidelity.NO_FALLBACK)
    t0 = time.perf_counter()
    rows = [r for s in splits for r in run_split(engine, s, cfg, settings, reference, lambda m: print(m, flush=True))]
    out = {"rows": rows, "codec_rows": [], "ttft_at_context": [], "splits": list(splits),
           "across_splits": bench_fidelity.choose_across_splits(rows),
           "chosen_then_confirmed": bench_fidelity.choose_then_confirm(rows),
           "adapter": fidelity_reference.adapter_label(model), "dtype": cfg.dtype, "threads": cfg.threads,
           "seed_offset": cfg.seed_offset, "settings": [s.name for s in settings], "new_tokens": cfg.new_tokens,
           "questions": cfg.questions, "seconds": round(time.perf_counter() - t0, 1)}
    if reference is not None:
        out.update({"reference": {"path": reference.path, "adapter": reference.adapter},
                    "full_prefill_against_reference": fidelity_reference.full_prefill_against(rows)})
    return fidelity_runner.write(out, cfg.out)


if __name__ == "__main__":
    main()
