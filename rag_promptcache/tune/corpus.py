"""Tune a model for one corpus: samples from its own modules and their retrieval neighbours (plus
general text), a check before and after on questions from modules kept out of training, and the
verdict: an adapter that does not make cached answers better, or makes full prefill's worse, is not
applied.

The check asks cloze questions ("how does the sentence that begins ... go on?") about held-out
modules, retrieved as `Corpus.ask` retrieves, and counts an answer right when it carries the next
words of that sentence (`rag.fidelity.answer_contains`). `kept`: of the base model's right answers
with full prefill, the share a setting also gets right. Not here: the CLI (`cli/tune_cmd.py`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rag_promptcache.model import adapter as adapters
from rag_promptcache.tune.layout import Layouter
from rag_promptcache.tune.recipe import FORMAT, module_text, probe, probe_prompts
from rag_promptcache.tune.samples import SampleMaker
from rag_promptcache.tune.texts import Passage, gather, held_out
from rag_promptcache.tune.train import Progress, TuneConfig, can_start_from, train

if TYPE_CHECKING:
    from rag_promptcache.rag import Corpus

CHECK_SHARE = 0.1
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


@dataclass(frozen=True, slots=True)
class Check:
    """Right answers out of `questions` per setting ("base/full", "base/none", "tuned/full", "tuned/none",
    and "default/full", "default/none" where an adapter ships for the model) and `kept` per setting: of
    base/full's right answers, the share it also gets right."""

    questions: int
    right: dict[str, int]
    kept: dict[str, float | None]


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


def corpus_passages(corpus: Corpus, neighbours: int = 6) -> tuple[list[Passage], dict[int, list[int]], list[int]]:
    """(passages, their retrieval neighbours, the indices kept out of training for the check)."""
    modules = corpus.table.modules()
    index = {m: i for i, (m, _) in enumerate(modules)}
    passages = [Passage("corpus", corpus.source(m), "", text) for m, text in modules]
    near = {}
    for i, (_, text) in enumerate(modules):
        near[i] = [index[m] for m, _ in corpus.search(text[:2000], neighbours + 1) if m in index and index[m] != i]
    # a stable tenth of the modules (one at least), by a hash of their ids, kept for the check
    ranked = sorted(range(len(modules)), key=lambda i: hashlib.sha256(modules[i][0].encode()).digest())
    check = sorted(ranked[: max(1, math.ceil(CHECK_SHARE * len(modules)))])
    return passages, near, check


def check_questions(corpus: Corpus, passages: list[Passage], indices: list[int], limit: int, seed: int,
                    k: int) -> list[dict[str, object]]:
    """Cloze questions about held-out modules, with the prompt `Corpus.ask` would build for each."""
    rng = random.Random(seed)
    out = []
    per_module = max(1, math.ceil(limit / max(len(indices), 1)))
    for i in indices:
        sentences = [s for s in _SENTENCE.split(" ".join(passages[i].text.split())) if 10 <= len(s.split()) <= 60]
        for sentence in rng.sample(sentences, min(per_module, len(sentences))):
            words = sentence.split()
            cut = rng.randint(4, min(8, len(words) - 4))
            question = f'How does the sentence that begins "{" ".join(words[:cut])}" go on?'
            ids = corpus.order([m for m, _ in corpus.search(question, k)])
            out.append({"question": question, "answer": " ".join(words[cut:cut + 3]).strip(",;:()\"'"),
                        "modules": [corpus.table.module(m)[0] for m in ids], "instructions": corpus.manifest.instructions})
            if len(out) >= limit:
                return out
    return out


def run_check(model, tokenizer, rows: list[dict[str, object]], layouter: Layouter, who: str) -> dict[str, list[bool]]:
    from rag_promptcache.rag.fidelity import answer_contains

    texts = probe(model, tokenizer, probe_prompts(rows, layouter), who, 4, [], {})
    return {setting: [answer_contains(t, str(r["answer"])) for t, r in zip(answers, rows)]
            for setting, answers in texts.items()}


def summarize(right: dict[str, list[bool]]) -> Check:
    ref = right["base/full"]
    kept = {s: (sum(a and b for a, b in zip(ref, r)) / sum(ref) if sum(ref) else None) for s, r in right.items()}
    return Check(len(ref), {s: sum(r) for s, r in right.items()}, kept)


def verdict(check: Check) -> tuple[bool, str]:
    """Applied only where the tuned model's cached answers keep more than the model's would without this
    tune (the base model's, and the shipped adapter's where one ships), and its full prefill answers no
    fewer questions than the base model's."""
    tuned = check.kept["tuned/none"]
    before = [(who, check.kept[f"{who}/none"]) for who in ("base", "default") if f"{who}/none" in check.kept]
    who, base = max(before, key=lambda b: -1.0 if b[1] is None else b[1])
    if base is None or tuned is None:
        return False, "the base model answered none of the check questions with full prefill: nothing to compare"
    if check.right["tuned/full"] < check.right["base/full"]:
        return False, (f"full prefill got worse with the adapter ({check.right['tuned/full']} against "
                       f"{check.right['base/full']} of {check.questions} right)")
    name = "the base model's" if who == "base" else "the shipped adapter's"
    if tuned <= base:
        return False, f"cached answers did not get better (kept {tuned:.2f} against {name} {base:.2f})"
    return True, f"cached answers kept {tuned:.2f} of full prefill's right answers, against {name} {base:.2f}"


def tune_corpus(corpus: Corpus, out: str | Path, cfg: TuneConfig, *, general: bool = True, check: int = 24, k: int = 4,
                progress: Callable[[Progress, dict[str, float]], None] | None = None) -> TuneReport:
    """Train an adapter for `corpus`'s model on its modules (and, with `general`, this machine's text)
    and check it; the adapter and `tune.json` go to `out`. Applying it is the caller's choice,
    on `TuneReport.applied`."""
    from rag_promptcache.model.loading import load_model, model_fingerprint

    out = Path(out)
    t0 = time.perf_counter()
    passages, near, held = corpus_passages(corpus)
    rows = check_questions(corpus, passages, held, check, cfg.seed, k) if check else []
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
    layouter = Layouter(tokenizer, corpus.manifest.mode)
    right = run_check(model, tokenizer, rows, layouter, "base") if rows else {}
    shipped = adapters.find(adapters.DEFAULT, corpus.manifest.model)
    recovery = "none"
    if shipped is not None and shipped.mode == corpus.manifest.mode:
        # what the user runs untuned is the shipped adapter: start from it where the shapes allow, keep
        # the recovery it was chosen for, and beat it to be applied
        recovery = shipped.recovery or recovery
        if can_start_from(shipped.path, cfg):
            cfg = replace(cfg, init=cfg.init or shipped.path)
        if rows:
            merged, _ = load_model(corpus.manifest.model, device="cpu", dtype="float32", adapter=shipped.path)
            right.update(run_check(merged, tokenizer, rows, layouter, "default"))
            del merged
    maker = SampleMaker(pool, corpus.manifest.instructions, k=(1, max(2, k + 2)), seed=cfg.seed, neighbors=neighbours)

    def stream(start: int):
        for i in itertools.count(start):
            s = maker(i)
            yield i, layouter.lay(s.instructions, [module_text(maker.passages[j]) for j in s.passages], s.question, s.answer)

    peft_model, state = train(model, stream, out, cfg, progress)
    check_out = None
    applied, reason = True, "no check questions: applied unchecked"
    if rows:
        right.update(run_check(peft_model, tokenizer, rows, layouter, "tuned"))
        check_out = summarize(right)
        applied, reason = verdict(check_out)
    report = TuneReport(out, applied, reason, state.step, state.samples, time.perf_counter() - t0, check_out,
                        state.losses[-50:])
    meta = {"format": FORMAT, "base_model": corpus.manifest.model, "base_fingerprint": base_fingerprint,
            "mode": corpus.manifest.mode, "recovery": recovery, "recipe": {**asdict(cfg), "corpus": str(corpus.path),
                                                                          "general": general},
            "metrics": {"check": asdict(check_out) if check_out else None, "applied": applied, "reason": reason}}
    (out / "tune.json").write_text(json.dumps(meta, indent=1))
    return report
