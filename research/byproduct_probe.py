"""Probe: is the KV a full prefill computes anyway a good enough module entry (docs/FIDELITY.md, "the full
prefill's KV as a by-product encoding")?

A full prefill of a question's prompt computes every retrieved module's KV, each after the modules
before it in that prompt (its neighbours for that question) and the first one after the instructions
alone, which is exactly its plain encoding. Kept, relocated back to the module's own encoding position,
that KV would cost nothing to make. This probe answers the fidelity splits' questions with every
module read from such a by-product entry, made from ANOTHER question's prompt (the first question
retrieving the module in a fixed shuffled order, never the question being answered, so no answer
reads KV computed from its own prompt; a module no other question retrieves falls back to its plain
entry), beside the same prompts over plain entries and over the engine's own `--neighbours 3`
entries (a second corpus of the same documents built with `Corpus.build(neighbours=3)`), with
recovery `none` and `last:1`, judged against the base model's full prefill (`--reference`) as the
fidelity scenario judges (rag/fidelity.py, bench/fidelity_reference.py). `temp:T+RECOVERY` reads the plain
entries with their keys scaled by 1/T (`tempered`: APE's attention temperature on the cached modules);
`pick:C+RECOVERY` reads a module's `--neighbours 3` entry where at least C of its three neighbours are in the
prompt, its plain entry otherwise (what `ingest --neighbours-present C` does), and `pick:C+gate` answers a
prompt whose every module is so covered with `none`, any other from plain entries with `last:1`:

    python -m research.byproduct_probe --split bench --k 4 8 12 --threads 2 --dtype bfloat16 \
        --reference docs/bench/fidelity-quiet-2026-11-25/tokens32/fidelity.json \
        --out docs/bench/byproduct-2026-12-02/bench

Writes fidelity.json / fidelity.md / fidelity_front.png in the fidelity scenario's format, rows named
`none`, `last:1`, `nbr:3+none`, `nbr:3+last:1`, `byp+none`, `byp+last:1`, and per row how many of the
prompts' module reads came from a by-product entry (`byproduct_share`). Speed-ups in the rows are rough
(the references' full-prefill TTFT against each setting's, not back to back): the entries cost nothing
at question time, so what is measured is answers. The entries and the donors are the package's
(rag/byproduct_eval.py, what `eval --byproduct` runs; the engine keeps such entries for a corpus
ingested `--kv lazy --byproduct`). Not here: the store's codec (entries are kept in the model's dtype,
as the native codec keeps them).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import fidelity as fidelity_runner
from rag_promptcache.bench import fidelity as bench_fidelity
from rag_promptcache.bench import fidelity_reference
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.decoding.sampling import Sampling
from rag_promptcache.engine.planning.plan import Plan
from rag_promptcache.rag.byproduct_eval import Donors
from rag_promptcache.rag.byproduct_eval import prefill_entries as byproduct_entries
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import EvalQuestion, Outcome, Reference, references, summarize
from rag_promptcache.store import MemoryStore
from rag_promptcache.store.base import ModuleKV

ENCODINGS = ("plain", "nbr", "byp")
SETTINGS = ("none", "last:1", "nbr:3+none", "nbr:3+last:1", "byp+none", "byp+last:1")


def parse_setting(spec: str) -> tuple[str, str]:
    """`none`, `last:1`, `nbr:3+none`, `byp+last:1`, `temp:0.9+none` -> (encoding, recovery)."""
    spec = spec.strip()
    head, plus, rec = spec.partition("+")
    if not plus:
        return "plain", spec
    if head == "byp":
        return "byp", rec
    if head == "nbr:3":
        return "nbr", rec
    if head.startswith("temp:") and _positive(head.removeprefix("temp:")):
        return head, rec
    if head.startswith("pick:") and head.removeprefix("pick:").isdigit():
        return head, rec
    raise ValueError(f"unknown probe setting {spec!r}; valid: RECOVERY, nbr:3+RECOVERY, byp+RECOVERY, temp:T+RECOVERY, "
                     "pick:C+RECOVERY, pick:C+gate")


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def tempered(kv: ModuleKV, temperature: float) -> ModuleKV:
    """`kv` with its keys scaled by 1 / `temperature`: every query's logits on these tokens divided by it,
    the others' left as they are (APE's attention temperature on cached contexts, without its scale
    factor, which would need the attention's log-sum-exp per part)."""
    return dataclasses.replace(kv, keys=(kv.keys.float() / temperature).to(kv.keys.dtype))


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|, per layer, the largest: rounding shows as a few units of the dtype's last place."""
    a, b = a.float(), b.float()
    return float(((a - b).abs().amax(dim=(1, 2, 3)) / b.abs().amax(dim=(1, 2, 3)).clamp_min(1e-12)).max())


def with_entries(plan: Plan, entries: dict[str, ModuleKV]) -> Plan:
    """`plan` reading `entries` in place of its modules' stored KV (the others as stored)."""
    return dataclasses.replace(plan, kvs={n: entries.get(n, kv) for n, kv in plan.kvs.items()}, sources=None)


def picked(module_ids: Sequence[str], near: dict[str, tuple[str, ...]], least: int) -> set[str]:
    """The modules of a prompt that read their `--neighbours` entry: those with at least `least` of the
    neighbours they were encoded after in the same prompt (the others read their plain entry)."""
    there = set(module_ids)
    return {m for m in module_ids if near.get(m) and len(there.intersection(near[m])) >= least}


def _answer(engine: PromptCache, prompt: str, recovery: str, entries: dict[str, ModuleKV], new_tokens: int,
            ref: Reference, name: str) -> Outcome:
    t0 = time.perf_counter()
    plan = with_entries(engine.plan(prompt, recovery=recovery, fallback=False), entries)
    res = engine.stream_plan(plan, Sampling(max_new_tokens=new_tokens, stop=bench_fidelity.STOP), t0=t0).consume()
    return Outcome(name, res.text, ref.question.judge(res.text), res.text.strip() == ref.text.strip(), res.ttft_s)


def _plain_kvs(engine: PromptCache, corpus: Corpus, module_ids: Sequence[str]) -> dict[str, ModuleKV]:
    """The modules' entries as `engine`'s store holds them (a corpus built with neighbours: those), a
    prompt of one module each (all of them would not fit the context window)."""
    return {m: engine.plan(corpus.prompt("?", [m]), recovery="none", fallback=False, misses="encode").kvs[m]
            for m in module_ids}


def run_split(engine: PromptCache, nbr_engine: PromptCache, split: str, cfg: argparse.Namespace,
              settings: list[str], reference: fidelity_reference.ReferenceRun | None, log,
              save=lambda rows: None) -> list[dict[str, object]]:
    """The split's rows, every k's handed to `save` (with all rows so far) as soon as it is done."""
    data, chunk = bench_fidelity.split_data(split, cfg.per_kind, cfg.seed_offset)
    questions = [EvalQuestion(q.question, (q.answer,)) for q in data.questions[: cfg.questions]]
    adapter = fidelity_reference.adapter_label(engine.model)
    parsed = {s: parse_setting(s) for s in settings}
    rows = []
    with tempfile.TemporaryDirectory(prefix="rpc-byproduct-") as tmp:
        corpus = Corpus.build(data.documents, f"{tmp}/corpus", engine=engine, chunk_tokens=chunk, progress=False)
        corpus.prepare()
        nbr = None
        near: dict[str, tuple[str, ...]] = {}
        if any(e == "nbr" or e.startswith("pick:") for e, _ in parsed.values()):
            nbr = Corpus.build(data.documents, f"{tmp}/nbr", engine=nbr_engine, chunk_tokens=chunk, progress=False,
                               neighbours=3)
            nbr.prepare()
            assert {m for m, _ in nbr.table.modules()} == {m for m, _ in corpus.table.modules()}, "other modules"
            nbr_kvs = _plain_kvs(nbr_engine, nbr, [m for m, _ in nbr.table.modules()])
            near = nbr.table.neighbours()
            plain = _plain_kvs(engine, corpus, list(nbr_kvs))
            for m, kv in nbr_kvs.items():  # the same tokens at the same place, another encoding
                assert kv.token_ids == plain[m].token_ids and kv.start == plain[m].start, m
        log(f"{split}: {len(data.documents)} documents, {len(corpus)} modules")
        for k in cfg.k:
            t0 = time.perf_counter()
            refs = references(corpus, questions, k, cfg.new_tokens, bench_fidelity.STOP, "dense")
            donors = Donors([r.module_ids for r in refs], cfg.donor_seed)
            lent: dict[tuple[str, int], ModuleKV] = {}
            first_diff = 0.0  # a prompt's first module against its plain entry: the same but for rounding
            lending = any(e == "byp" for e, _ in parsed.values())
            for q in donors.order if lending else ():  # each prompt's full prefill, kept only where it lends
                wanted = donors.lends(q)
                if wanted:
                    made, _ = byproduct_entries(engine, refs[q].prompt)
                    lent.update({(m, q): made[m] for m in wanted})
                    first = corpus.order(refs[q].module_ids)[0]
                    plain = _plain_kvs(engine, corpus, [first])[first]
                    first_diff = max(first_diff, *(relative_diff(a, b) for a, b in (
                        (made[first].keys, plain.keys), (made[first].values, plain.values))))
            outcomes: dict[str, list[Outcome]] = {s: [] for s in settings}
            lent_reads = reads = 0
            picks = {e: [0, 0] for e, _ in parsed.values() if e.startswith("pick:")}  # nbr reads, gated to none
            gated: dict[str, list] = {e: [] for e in picks}  # the prompts a `gate` setting answers plain with last:1
            for i, r in enumerate(refs):
                entries = {"plain": {}, "nbr": {m: nbr_kvs[m] for m in r.module_ids} if nbr else {}, "byp": {}}
                temps = {e for e, _ in parsed.values() if e.startswith("temp:")}
                if temps:
                    stored = _plain_kvs(engine, corpus, r.module_ids)
                    entries.update({e: {m: tempered(kv, float(e.removeprefix("temp:"))) for m, kv in stored.items()}
                                    for e in temps})
                for m in r.module_ids:
                    d = donors.donor(m, i)
                    reads += 1
                    if d is not None and lending:
                        entries["byp"][m] = lent[(m, d)]
                        lent_reads += 1
                for e in picks:
                    chosen = picked(r.module_ids, near, int(e.removeprefix("pick:")))
                    entries[e] = {m: nbr_kvs[m] for m in chosen}
                    picks[e][0] += len(chosen)
                    picks[e][1] += len(chosen) == len(r.module_ids)
                    if len(chosen) < len(r.module_ids) and (e, "gate") in parsed.values():
                        gated[e].append(r)
                for s in settings:
                    encoding, rec = parsed[s]
                    if rec == "gate":  # every module read after its neighbours: nothing recomputed; else plain last:1
                        rec = "none" if len(entries[encoding]) == len(r.module_ids) else "last:1"
                        if rec == "last:1":
                            encoding = "plain"
                    outcomes[s].append(_answer(engine, r.prompt, rec, entries[encoding], cfg.new_tokens, r, s))
            for s in settings:
                report = summarize(s, k, refs, outcomes[s])
                row = fidelity_reference.row(
                    split, adapter, "shared_prefix", "native", report, reference,
                    recomputed_share=(bench_fidelity.recomputed_share(engine, refs, parsed[s][1]) if parsed[s][1] != "gate" else
                                      bench_fidelity.recomputed_share(engine, gated[parsed[s][0]], "last:1")
                                      * sum(g.context_tokens for g in gated[parsed[s][0]])
                                      / sum(r.context_tokens for r in refs)),
                    byproduct_share=lent_reads / max(1, reads) if parsed[s][0] == "byp" else 0.0,
                    picked_share=picks[parsed[s][0]][0] / max(1, reads) if parsed[s][0] in picks else None,
                    all_picked_share=picks[parsed[s][0]][1] / len(refs) if parsed[s][0] in picks else None,
                    first_module_max_diff=first_diff)
                rows.append(row)
                log(f"{split} k={k} {s}: full {row['full_correct']}/{row['with_answer']}"
                    + (f" (reference {row['reference_full_correct']})" if reference else "")
                    + f", cached {row['cached_correct']}, retained {row['retained']:.2f}, kept {row['kept']:.2f}"
                    + (f", own kept {row['own_kept']:.2f}" if reference else "")
                    + f", by-product reads {row['byproduct_share']:.2f}"
                    + (f", neighbour reads {row['picked_share']:.2f}, all {row['all_picked_share']:.2f}"
                       if row["picked_share"] is not None else ""))
            log(f"{split} k={k}: {time.perf_counter() - t0:.0f} s; a prompt's first module against its plain entry: "
                f"max |diff| / max |entry| {first_diff:.4f}")
            save(rows)
        corpus.close()
        if nbr is not None:
            nbr.close()
    return rows


def merged(runs: list[fidelity_reference.ReferenceRun]) -> fidelity_reference.ReferenceRun:
    """Several reference runs of one model (bench and held-out in one, manuals in another) as one."""
    adapters = {r.adapter for r in runs}
    if len(adapters) != 1:
        raise ValueError(f"the references carry different adapters {sorted(adapters)}; pass one model's runs")
    answers = {}
    for r in runs:
        answers.update(r.answers)
    return fidelity_reference.ReferenceRun(" + ".join(r.path for r in runs), adapters.pop(), answers)


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=(*bench_fidelity.SPLITS, "all"), nargs="+", default=["bench"])
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8, 12])
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--questions", type=int, default=42)
    ap.add_argument("--per-kind", type=int, default=6, help="documents per kind (6: all; fewer: a smoke run, no --reference)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed-offset", type=int, default=0)
    ap.add_argument("--donor-seed", type=int, default=0, help="the shuffled order donors are chosen in")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--adapter", default="default")
    ap.add_argument("--reference", type=Path, nargs="+", default=[],
                    help="the base model's fidelity.json(s) over the same splits, k and questions (one per split group)")
    ap.add_argument("--out", type=Path, required=True)
    cfg = ap.parse_args(argv)
    settings = [s.strip() for s in cfg.settings.split(",") if s.strip()]
    for s in settings:
        parse_setting(s)
    splits = bench_fidelity.SPLITS if "all" in cfg.split else tuple(cfg.split)
    reference = merged([fidelity_reference.load(p) for p in cfg.reference]) if cfg.reference else None
    if reference is not None:
        for s in splits:  # before the model loads: the same questions, or refused by name
            qs = [(q.question, (q.answer,)) for q in bench_fidelity.split_data(s, cfg.per_kind, cfg.seed_offset)[0].questions[: cfg.questions]]
            fidelity_reference.check(reference, {s: qs}, tuple(cfg.k))
    torch.set_num_threads(cfg.threads)
    from rag_promptcache.model.loading import load_model

    model, tok = load_model("smollm2-135m-instruct", dtype=cfg.dtype, adapter=cfg.adapter)
    engines = [PromptCache(model, tok, store=MemoryStore(), name="smollm2-135m-instruct", **bench_fidelity.NO_FALLBACK)
               for _ in range(2)]
    t0 = time.perf_counter()
    done: list[dict[str, object]] = []

    def save(split_rows: list[dict[str, object]]) -> dict[str, object]:
        """Every finished k written out: a run stopped later keeps what finished."""
        rows = done + split_rows
        out = {"rows": rows, "codec_rows": [], "ttft_at_context": [], "splits": list(dict.fromkeys(r["split"] for r in rows)),
               "across_splits": bench_fidelity.choose_across_splits(rows),
               "chosen_then_confirmed": bench_fidelity.choose_then_confirm(rows),
               "adapter": fidelity_reference.adapter_label(model), "dtype": cfg.dtype, "threads": cfg.threads,
               "seed_offset": cfg.seed_offset, "donor_seed": cfg.donor_seed, "settings": settings,
               "new_tokens": cfg.new_tokens, "questions": cfg.questions, "seconds": round(time.perf_counter() - t0, 1)}
        if reference is not None:
            out.update({"reference": {"path": reference.path, "adapter": reference.adapter},
                        "full_prefill_against_reference": fidelity_reference.full_prefill_against(rows)})
        return fidelity_runner.write(out, cfg.out)

    out: dict[str, object] = {}
    for s in splits:
        done += run_split(*engines, s, cfg, settings, reference, lambda m: print(m, flush=True), save)
        out = save([])
    return out


if __name__ == "__main__":
    main()
