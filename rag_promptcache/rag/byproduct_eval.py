"""Would this corpus answer as well from by-product entries (`ingest --kv lazy --byproduct`)? `eval --byproduct`.

A by-product entry is a module's KV as the full prefill of a question that retrieved it computed it
(engine/kv/byproduct.py). Here each question is answered with every module read from the entry
*another* question's prompt left of it: the first, in a fixed shuffled order (`Donors`), of the other
questions that retrieved it, never the question itself (a question answered from its own prefill's
entries is its full prefill again, and says nothing); a module no other question retrieves keeps its
plain entry, as a lazy corpus's warming would store it. Each recovery setting runs twice over the same
prompts, on plain entries and on those, judged against full prefill as `eval` judges (`SettingReport`:
retained, kept); `recommend_byproduct` names the by-product setting that recomputes least among those
passing the rule (`fidelity.passes`: what docs/FIDELITY.md measured on its splits).

Everything runs on an engine of its own over the corpus's model (exact memory store, no fallback to full
prefill, no prefix cache), so the corpus's store is neither read nor written.

Not here: keeping entries in a corpus (the engine's `keep_kv`), printing (cli/eval_byproduct.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rag_promptcache.rag.fidelity import (DEFAULT_NEW_TOKENS, EvalQuestion, Outcome, Reference, SettingReport,
                                          module_prompt, summarize, too_few)

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.engine.result import Result
    from rag_promptcache.rag.corpus import Corpus
    from rag_promptcache.store.base import ModuleKV

PREFIX = "byproduct+"  # a by-product row's label: PREFIX + its recovery


class Donors:
    """Which question's prompt lends each module its by-product entry: the first in a fixed shuffled
    order of the questions that retrieved it, other than the question being answered."""

    def __init__(self, module_ids: Sequence[Sequence[str]], seed: int = 0) -> None:
        order = list(range(len(module_ids)))
        random.Random(seed).shuffle(order)
        self.order = order
        self.of: dict[str, list[int]] = {}
        for q in order:
            for m in module_ids[q]:
                if len(self.of.setdefault(m, [])) < 2:  # the first two: one is always another question's
                    self.of[m].append(q)

    def donor(self, module: str, question: int) -> int | None:
        """The question whose prompt lends `module` to `question`; None: no other question retrieved it."""
        return next((q for q in self.of.get(module, ()) if q != question), None)

    def lends(self, question: int) -> list[str]:
        """The modules whose entry some question takes from `question`'s prompt."""
        return [m for m, qs in self.of.items() if question in qs]


def prefill_entries(engine: PromptCache, prompt: str) -> tuple[dict[str, ModuleKV], torch.Tensor]:
    """The prompt's full prefill (the engine's own, of the tokens `generate(use_cache=False)` runs) → (each
    module's by-product entry from it, as the engine keeps one: engine/kv/byproduct.py; the next-token
    logits [V]). Its modules' plain entries are encoded first: what each entry must match in tokens."""
    from rag_promptcache.engine.kv import byproduct
    from rag_promptcache.engine.kv.assemble import release
    from rag_promptcache.engine.planning.plan import uncached
    from rag_promptcache.engine.prefix.prefix_cache import cache_layers
    from rag_promptcache.engine.prompt.compiler import ROOT, Unit

    plan = engine.plan(prompt, recovery="none", fallback=False, misses="encode")
    # what an entry needs of its module: its name, tokens and encoding position, as its plain entry says
    units = [Unit(n, kv.token_ids, (), kv.start, ()) for n, kv in plan.kvs.items() if n != ROOT]
    at = byproduct.located(plan.pieces, units)
    kept = [byproduct.Byproduct(plan.sources[u.name], u, *at[u.name], engine.store) for u in units if u.name in at]
    full = uncached(plan)
    out = engine.prefill(full)
    try:
        made = byproduct.entries(kept, full.pieces, *cache_layers(out.cache), engine.relocator, engine.fingerprint,
                                 engine.mode)
        return {b.unit.name: kv for b, kv in made}, out.logits
    finally:
        release(out.cache)


def answer_with_entries(engine: PromptCache, prompt: str, recovery: str, entries: dict[str, ModuleKV],
                        max_new_tokens: int, stop: tuple[str, ...] = ()) -> Result:
    """`prompt` answered with `recovery`, its modules read from `entries` where given (else as stored)."""
    from rag_promptcache.engine.decoding.sampling import Sampling

    plan = engine.plan(prompt, recovery=recovery, max_new_tokens=max_new_tokens, fallback=False, misses="encode")
    plan = dataclasses.replace(plan, kvs={n: entries.get(n, kv) for n, kv in plan.kvs.items()}, sources=None)
    return engine.stream_plan(plan, Sampling(max_new_tokens=max_new_tokens, stop=stop)).consume()


def evaluate_byproduct(corpus: Corpus, questions: Sequence[EvalQuestion], recoveries: Sequence[str], k: int = 4,
                       max_new_tokens: int = DEFAULT_NEW_TOKENS, stop: tuple[str, ...] = (), seed: int = 0,
                       retrieval: str = "hybrid") -> list[SettingReport]:
    """Full prefill's answer to each question, then each recovery's over plain entries and over other
    questions' by-product entries (`Donors` with `seed`): two reports per recovery, plain first, the
    by-product one labelled `PREFIX + recovery`. Needs two questions or more (an entry comes from another)."""
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.store import MemoryStore

    if len(questions) < 2:
        raise ValueError("eval --byproduct needs two questions or more: a question reads the entries other "
                         "questions' prompts left")
    source = corpus.prepare()
    engine = PromptCache(source.model, source.tokenizer, store=MemoryStore(max_bytes=None), mode=source.mode,
                         name=source.model_name, fallback="never", prefix_cache_bytes=0)
    try:
        engine.add_schema(dataclasses.replace(corpus.schema, byproduct=False))  # plain entries, in its own store
        refs = []
        for q in questions:
            p = module_prompt(corpus, q.question, k, retrieval)
            res = engine.generate(p.text, use_cache=False, max_new_tokens=max_new_tokens, stop=stop)
            refs.append(Reference(q, p.module_ids, p.text, res.text, res.ttft_s, p.context_tokens))
        donors = Donors([r.module_ids for r in refs], seed)
        lent: dict[tuple[str, int], ModuleKV] = {}
        for q in donors.order:  # each prompt's full prefill, kept only where it lends an entry
            if wanted := donors.lends(q):
                made, _ = prefill_entries(engine, refs[q].prompt)
                lent.update({(m, q): made[m] for m in wanted if m in made})
        reports = []
        for rec in recoveries:
            rows: dict[str, list[Outcome]] = {rec: [], PREFIX + rec: []}
            for i, r in enumerate(refs):
                borrowed = {m: lent[(m, d)] for m in r.module_ids if (d := donors.donor(m, i)) is not None
                            and (m, d) in lent}
                for label, entries in ((rec, {}), (PREFIX + rec, borrowed)):
                    res = answer_with_entries(engine, r.prompt, rec, entries, max_new_tokens, stop)
                    rows[label].append(Outcome(label, res.text, r.question.judge(res.text),
                                               res.text.strip() == r.text.strip(), res.ttft_s))
            reports += [summarize(label, k, refs, outcomes) for label, outcomes in rows.items()]
        return reports
    finally:
        engine.background.close()
        engine.store.close()


def recommend_byproduct(reports: Sequence[SettingReport]) -> SettingReport | None:
    """Of the by-product rows meeting the targets, the first (the settings in the order asked: put the one
    recomputing least first); None where none does, or where full prefill's right answers are too few to
    judge by (`fidelity.too_few`, as `eval`)."""
    if not reports or too_few(reports[0]) is not None:
        return None
    return next((r for r in reports if r.recovery.startswith(PREFIX) and r.meets), None)
