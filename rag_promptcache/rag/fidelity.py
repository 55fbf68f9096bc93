"""Answer fidelity on a user's own corpus: do cached answers say what full prefill of the same tokens says?

For each question: retrieve k modules, build the prompt, generate greedily once with full prefill
(`use_cache=False`, the reference) and once per recovery setting from the cache. With an expected
answer, an answer is right when it contains it (`answer_contains`); without one, only agreement with
full prefill's text is measured, on the whole answer (up to `max_new_tokens`). `fastest_retaining`
is the one rule a setting is recommended by (`eval`) and the engine default was chosen by (the bench's
`fidelity` scenario, docs/FIDELITY.md): the fastest that keeps >= 95% of full prefill's right answers.
`rag-promptcache eval` and the bench both use this module. Not here: reading question files (cli/),
generating benchmark data (bench/fidelity_data.py), writing the choice into a corpus (`Corpus.set_recovery`).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.corpus import Corpus

DEFAULT_NEW_TOKENS = 64  # the answer judged: long enough for a sentence or two, not just its first words
TARGET_RETAINED = 0.95  # of full prefill's right answers a recommended setting keeps
K = TypeVar("K", bound=Hashable)


def fastest_retaining(retained: Mapping[K, float | None], speedup: Mapping[K, float], *,
                      target: float = TARGET_RETAINED, min_speedup: float = 0.0) -> K | None:
    """The rule: of the settings whose `retained` (cached right answers / full prefill's; None: not
    measurable) is at least `target` and whose speed-up is at least `min_speedup`, the fastest.
    None when no setting qualifies. Keys are whatever names a setting (a recovery, or mode and recovery)."""
    met = [s for s, r in retained.items() if r is not None and r >= target and speedup.get(s, 0.0) >= min_speedup]
    return max(met, key=lambda s: speedup[s]) if met else None


@dataclass(frozen=True, slots=True)
class EvalQuestion:
    question: str
    answer: str | None = None  # None: measure agreement with full prefill only


@dataclass(frozen=True, slots=True)
class Reference:
    """One question's prompt and full prefill's answer to it."""

    question: EvalQuestion
    module_ids: tuple[str, ...]
    prompt: str
    text: str
    ttft_s: float
    context_tokens: int

    @property
    def right(self) -> bool | None:
        return None if self.question.answer is None else answer_contains(self.text, self.question.answer)


@dataclass(frozen=True, slots=True)
class Outcome:
    recovery: str
    text: str
    right: bool | None
    agrees: bool  # the same text as full prefill's answer
    ttft_s: float


@dataclass(frozen=True, slots=True)
class QuestionResult:
    """One question under one setting: full prefill's and the cached answer side by side."""

    question: str
    expected: str | None
    full: str
    cached: str
    full_right: bool | None
    cached_right: bool | None
    agrees: bool

    @property
    def failed(self) -> bool:
        """The cached answer is wrong (with an expected answer), or differs from full prefill's (without)."""
        return self.cached_right is False if self.expected is not None else not self.agrees

    def as_dict(self) -> dict[str, object]:
        return {"question": self.question, "expected": self.expected, "full": self.full, "cached": self.cached,
                "full_right": self.full_right, "cached_right": self.cached_right, "agrees": self.agrees}


@dataclass(frozen=True, slots=True)
class SettingReport:
    """One recovery setting over all questions at one k."""

    recovery: str
    k: int
    num_questions: int
    num_with_answer: int
    full_correct: int
    cached_correct: int
    agreement: float  # fraction of questions whose cached answer text equals full prefill's
    full_ttft_s: float  # medians over the questions
    cached_ttft_s: float
    context_tokens: float  # mean retrieved-module tokens per prompt
    results: tuple[QuestionResult, ...] = ()  # per question, in question order

    @property
    def failures(self) -> tuple[QuestionResult, ...]:
        return tuple(r for r in self.results if r.failed)

    @property
    def full_accuracy(self) -> float | None:
        return self.full_correct / self.num_with_answer if self.num_with_answer else None

    @property
    def cached_accuracy(self) -> float | None:
        return self.cached_correct / self.num_with_answer if self.num_with_answer else None

    @property
    def retained(self) -> float | None:
        """Cached accuracy over full prefill's; agreement when no question has an answer."""
        if not self.num_with_answer:
            return self.agreement
        return self.cached_correct / self.full_correct if self.full_correct else None

    @property
    def kept(self) -> float | None:
        """Paired: of the questions full prefill answers right, the share the cached setting answers right
        too (never above 1, unlike `retained`, which also counts answers only the cache gets right)."""
        both = sum(bool(r.full_right and r.cached_right) for r in self.results)
        return both / self.full_correct if self.results and self.full_correct else None

    @property
    def speedup(self) -> float:
        return self.full_ttft_s / self.cached_ttft_s

    def as_dict(self) -> dict[str, object]:
        return {"recovery": self.recovery, "k": self.k, "questions": self.num_questions,
                "with_answer": self.num_with_answer, "full_correct": self.full_correct,
                "cached_correct": self.cached_correct, "full_accuracy": self.full_accuracy,
                "cached_accuracy": self.cached_accuracy, "retained": self.retained, "kept": self.kept, "agreement": self.agreement,
                "full_ttft_s": self.full_ttft_s, "cached_ttft_s": self.cached_ttft_s, "speedup": self.speedup,
                "context_tokens": self.context_tokens}


def answer_contains(text: str, expected: str) -> bool:
    """Whether `text` states `expected` as a whole word or number (1,234 counts as 1234), any case."""
    flat = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    return re.search(rf"(?<!\w){re.escape(expected.strip())}(?!\w)", flat, re.IGNORECASE) is not None


def read_questions(path: str | Path) -> list[EvalQuestion]:
    """JSON lines, each {"question": ..., "answer": optional}; blank lines skipped."""
    out: list[EvalQuestion] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e.msg}") from e
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
            raise ValueError(f'{path}:{n}: each line is {{"question": "...", "answer": "..." (optional)}}')
        answer = row.get("answer")
        if answer is not None and (not isinstance(answer, (str, int, float)) or not str(answer).strip()):
            raise ValueError(f"{path}:{n}: answer must be a non-empty string or number, got {answer!r}")
        out.append(EvalQuestion(row["question"], None if answer is None else str(answer)))
    if not out:
        raise ValueError(f"{path} holds no questions")
    return out


def references(
    corpus: Corpus, questions: Iterable[EvalQuestion], k: int, max_new_tokens: int = DEFAULT_NEW_TOKENS,
    stop: tuple[str, ...] = (),
) -> list[Reference]:
    """Retrieve as `Corpus.ask` does and answer each question by full prefill of the prompt's tokens."""
    engine = corpus.prepare()
    out = []
    for q in questions:
        ids = tuple(m for m, _ in corpus.search(q.question, k))
        prompt = corpus.prompt(q.question, corpus.order(ids))
        res = engine.generate(prompt, use_cache=False, max_new_tokens=max_new_tokens, stop=stop)
        context = sum(corpus.table.module(m)[1] for m in ids)
        out.append(Reference(q, ids, prompt, res.text, res.ttft_s, context))
    return out


def cached(engine: PromptCache, refs: Sequence[Reference], recovery: str, max_new_tokens: int = DEFAULT_NEW_TOKENS,
           stop: tuple[str, ...] = ()) -> list[Outcome]:
    """Each reference's prompt answered from the cache with `recovery`."""
    engine.generate(refs[0].prompt, recovery=recovery, max_new_tokens=1)  # warm-up: no cold first timing
    return [answer(engine, r, recovery, max_new_tokens, stop) for r in refs]


def answer(engine: PromptCache, ref: Reference, recovery: str, max_new_tokens: int = DEFAULT_NEW_TOKENS,
           stop: tuple[str, ...] = ()) -> Outcome:
    """One reference's prompt answered from the cache with `recovery`, judged against full prefill's answer."""
    res = engine.generate(ref.prompt, recovery=recovery, max_new_tokens=max_new_tokens, stop=stop)
    right = None if ref.question.answer is None else answer_contains(res.text, ref.question.answer)
    return Outcome(recovery, res.text, right, res.text.strip() == ref.text.strip(), res.ttft_s)


def summarize(recovery: str, k: int, refs: Sequence[Reference], outcomes: Sequence[Outcome]) -> SettingReport:
    assert len(refs) == len(outcomes) > 0, f"{len(refs)=} {len(outcomes)=}"
    answered = [(r, o) for r, o in zip(refs, outcomes) if r.question.answer is not None]
    return SettingReport(
        recovery=recovery, k=k, num_questions=len(refs), num_with_answer=len(answered),
        full_correct=sum(bool(r.right) for r, _ in answered), cached_correct=sum(bool(o.right) for _, o in answered),
        agreement=sum(o.agrees for o in outcomes) / len(outcomes),
        full_ttft_s=statistics.median(r.ttft_s for r in refs), cached_ttft_s=statistics.median(o.ttft_s for o in outcomes),
        context_tokens=sum(r.context_tokens for r in refs) / len(refs),
        results=tuple(QuestionResult(r.question.question, r.question.answer, r.text.strip(), o.text.strip(), r.right,
                                     o.right, o.agrees) for r, o in zip(refs, outcomes)),
    )


def recommend(reports: Sequence[SettingReport]) -> SettingReport | None:
    """The setting `fastest_retaining` picks among these (one k), or None when none keeps the target."""
    best = fastest_retaining({r.recovery: r.retained for r in reports}, {r.recovery: r.speedup for r in reports})
    return next((r for r in reports if r.recovery == best), None)


def evaluate(
    corpus: Corpus,
    questions: Sequence[EvalQuestion],
    recoveries: Sequence[str],
    k: int = 4,
    max_new_tokens: int = DEFAULT_NEW_TOKENS,
) -> list[SettingReport]:
    """Full prefill once per question, then every recovery setting: one report per setting."""
    from rag_promptcache.engine.planning.recovery import Recovery

    if not questions:
        raise ValueError("no questions to evaluate")
    specs = [str(Recovery.parse(r)) for r in recoveries]  # bad specs fail before any model work
    refs = references(corpus, questions, k, max_new_tokens)
    return [summarize(s, k, refs, cached(corpus.engine, refs, s, max_new_tokens)) for s in specs]
