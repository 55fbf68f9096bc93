"""Tune a model for one corpus: samples from its own modules and their retrieval neighbours (plus
general text), and a check before and after (`check.py`: questions made from modules kept out of
training, or the user's own): an adapter that does not make cached answers better, or makes full
prefill's worse, is not applied. Not here: the CLI (`cli/tune_cmd.py`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rag_promptcache.model import adapter as adapters
from rag_promptcache.model import links
from rag_promptcache.tune.check import (Check, answers_of, check_questions, judge, made_questions, summarize,
                                        too_few_to_judge, verdict)
from rag_promptcache.tune.layout import Layouter, Neighbourhood
from rag_promptcache.tune.recipe import FORMAT, module_text
from rag_promptcache.tune.samples import SampleMaker
from rag_promptcache.tune.texts import Passage, gather, held_out
from rag_promptcache.tune.train import Progress, TuneConfig, can_start_from, max_len_for, train

if TYPE_CHECKING:
    from rag_promptcache.rag import Corpus
    from rag_promptcache.rag.fidelity import EvalQuestion

CHECK_SHARE = (0.1, 0.25)  # the share of modules kept out of training for the check: at least, at most
# What `tune_corpus` is doing, in order, as its `phase` callback hears it: (name, models whose answers
# the phase asks for; none while training). The checks come on top of the training budget.
PHASES = ("checking before", "training", "checking after")


@dataclass(slots=True)
class TuneReport:
    adapter: Path
    applied: bool
    reason: str
    steps: int
    samples: int
    seconds: float
    check: Check | None = None
    losses: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["adapter"] = str(self.adapter)
        return out


def corpus_passages(corpus: Corpus, check: int, seed: int, neighbours: int = 6
                    ) -> tuple[list[Passage], dict[int, list[int]], list[int]]:
    """(passages, their retrieval neighbours, the indices kept out of training for the check: a stable
    tenth of them, then more, up to a quarter, until `check` questions can be made from them)."""
    modules = corpus.table.modules()
    index = {m: i for i, (m, _) in enumerate(modules)}
    passages = [Passage("corpus", corpus.source(m), "", text) for m, text in modules]
    near = {}
    for i, (_, text) in enumerate(modules):
        near[i] = [index[m] for m, _ in corpus.search(text[:2000], neighbours + 1) if m in index and index[m] != i]
    ranked = sorted(range(len(modules)), key=lambda i: hashlib.sha256(modules[i][0].encode()).digest())
    held, most = max(1, math.ceil(CHECK_SHARE[0] * len(modules))), max(1, int(CHECK_SHARE[1] * len(modules)))
    while held < most and len(made_questions([passages[i].text for i in ranked[:held]], check, seed)) < check:
        held += 1
    return passages, near, sorted(ranked[:held])


def neighbourhood(corpus: Corpus) -> Neighbourhood | None:
    """What the corpus encodes each module after (`ingest --neighbours M`), by module text; None: nothing."""
    if not corpus.manifest.neighbours:
        return None
    text = dict(corpus.table.modules())
    return Neighbourhood({text[m]: tuple(text[n] for n in near if n in text)
                          for m, near in corpus.table.neighbours().items() if m in text}, corpus.manifest.neighbours_present)


def tune_corpus(corpus: Corpus, out: str | Path, cfg: TuneConfig, *, general: bool = True, check: int = 24, k: int = 4,
                questions: Sequence[EvalQuestion] = (),
                progress: Callable[[Progress, dict[str, float]], None] | None = None,
                phase: Callable[[str, int], None] | None = None) -> TuneReport:
    """Train an adapter for `corpus`'s model on its modules (and, with `general`, this machine's text)
    and check it on `questions` (all of them), or on `check` questions made from held-out modules,
    each over `k` retrieved modules; the adapter and `tune.json` go to `out`. Applying it is the
    caller's choice, on `TuneReport.applied`. `phase(name, models)` hears each of PHASES as it starts
    (a check phase only where there is a check). Where the base model's full prefill answers too few of
    the check questions to judge an adapter (`check.too_few_to_judge`), it stops before training and
    says so: the report's reason names `--questions`."""
    from rag_promptcache.model.loading import load_model, model_fingerprint

    out = Path(out)
    t0 = time.perf_counter()
    passages, near, held = corpus_passages(corpus, 0 if questions else check, cfg.seed)
    rows = []
    if check or questions:
        rows = check_questions(corpus, [passages[i].text for i in held], check, cfg.seed, k, questions)
    train_idx = [i for i in range(len(passages)) if i not in set(held)]
    pool = [passages[i] for i in train_idx]
    remap = {old: new for new, old in enumerate(train_idx)}
    neighbours = {remap[i]: [remap[j] for j in near[i] if j in remap] for i in train_idx}
    if general:
        pool += [p for p in gather() if not held_out(p.source)]
    if not pool:
        raise ValueError("the corpus has no modules to train on")
    model, tokenizer = load_model(corpus.manifest.model, device="cpu", dtype="float32", adapter="none")
    base_fingerprint = model_fingerprint(model)
    served = neighbourhood(corpus)  # trained and checked in the layout the corpus serves
    if cfg.max_len is None:  # the default, recorded: longer after neighbours, whose copies a sample carries
        cfg = replace(cfg, max_len=max_len_for(corpus.manifest.neighbours if served is not None else 0))
    layouter = Layouter(tokenizer, corpus.manifest.mode, near=served)
    vocab = model.get_input_embeddings().weight.shape[0]  # link ids follow the vocabulary (model/links.py)
    linked = Layouter(tokenizer, corpus.manifest.mode, range(vocab, vocab + cfg.links), near=served) if cfg.links else layouter
    shipped = adapters.find(adapters.DEFAULT, corpus.manifest.model)
    if rows and phase is not None:
        phase(PHASES[0], 2 if shipped is not None and shipped.mode == corpus.manifest.mode else 1)
    texts = answers_of(model, tokenizer, rows, layouter, "base") if rows else {}
    if rows and not questions and (too_few := too_few_to_judge(rows, texts)):
        # said before training, not after it: a check that cannot judge would only waste the budget
        report = TuneReport(out, False, too_few, 0, 0, time.perf_counter() - t0, summarize(rows, judge(rows, texts)))
        out.mkdir(parents=True, exist_ok=True)
        (out / "tune.json").write_text(json.dumps({"format": FORMAT, "base_model": corpus.manifest.model, "metrics": {
            "check": asdict(report.check), "applied": False, "reason": too_few}}, indent=1))
        return report
    recovery = "none"
    if shipped is not None and shipped.mode == corpus.manifest.mode:
        # what the user runs untuned is the shipped adapter: start from it where the shapes allow, keep
        # the recovery it was chosen for, and beat it to be applied
        recovery = shipped.recovery or recovery
        if can_start_from(shipped.path, cfg):
            cfg = replace(cfg, init=cfg.init or shipped.path)
        if rows:
            merged, _ = load_model(corpus.manifest.model, device="cpu", dtype="float32", adapter=shipped.path)
            # its link and wrapper ids as the merged model numbers them (wrapper rows come first)
            link_ids = links.ids(merged, shipped.num_links) if shipped.num_links else ()
            shipped_layouter = Layouter(tokenizer, corpus.manifest.mode, link_ids, links.wrap_ids(merged), served)
            texts.update(answers_of(merged, tokenizer, rows, shipped_layouter, "default"))
            del merged
    if cfg.links:
        recovery = f"links:{cfg.links}"
    maker = SampleMaker(pool, corpus.manifest.instructions, k=(1, max(2, k + 2)), seed=cfg.seed, neighbors=neighbours)

    def stream(start: int):
        for i in itertools.count(start):
            s = maker(i)
            yield i, linked.lay(s.instructions, [module_text(maker.passages[j]) for j in s.passages], s.question, s.answer)

    if phase is not None:
        phase(PHASES[1], 0)
    peft_model, state = train(model, stream, out, cfg, progress)
    check_out = None
    applied, reason = True, "no check asked for: applied unchecked"
    if rows:
        if phase is not None:
            phase(PHASES[2], 1)
        texts.update(answers_of(peft_model, tokenizer, rows, linked, "tuned"))
        check_out = summarize(rows, judge(rows, texts))
        applied, reason = verdict(check_out)
    elif check:
        applied, reason = False, ("no check question could be made from the held-out modules (no sentence long "
                                  "enough): ask your own with --questions, or apply it unchecked with --check 0")
    report = TuneReport(out, applied, reason, state.step, state.samples, time.perf_counter() - t0, check_out,
                        state.losses[-50:])
    meta = {"format": FORMAT, "base_model": corpus.manifest.model, "base_fingerprint": base_fingerprint,
            "mode": corpus.manifest.mode, "recovery": recovery, "recipe": {**asdict(cfg), "corpus": str(corpus.path),
                                                                          "general": general},
            "metrics": {"check": asdict(check_out) if check_out else None, "applied": applied, "reason": reason}}
    (out / "tune.json").write_text(json.dumps(meta, indent=1))
    return report
