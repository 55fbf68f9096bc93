"""Answer fidelity on a user's own corpus: do cached answers say what full prefill of the same tokens says?

For each question: retrieve k modules, build the prompt, generate greedily once with full prefill
(`use_cache=False`, the reference) and once per recovery setting from the cache. With an expected
answer (or several), an answer is right when it states one of them (`answer_contains`: case, thousands
separators, "%"/"percent" and number words do not matter); without one, only agreement with
full prefill's text is measured, on the whole answer (up to `max_new_tokens`). `passes` is the one rule
a setting is recommended by (`eval`, `eval --codec`, `eval --byproduct`) and the engine default is chosen
by (the bench's `fidelity` scenario, docs/FIDELITY.md): it retains >= 95% of full prefill's right answers
(`SettingReport.retained`, its right answers over full prefill's) and keeps >= 90% of them, paired
(`SettingReport.kept`: a question full prefill answers right and the cache wrong is lost even when
another question only the cache answers right would make the totals match); `fastest_passing` takes the
fastest setting that passes.
`rag-promptcache eval` (through `rag.evaluation`) and the bench both use this module. `interval` and
`MIN_RIGHT` say how much a share measured on few answers tells; below `MIN_TO_RECOMMEND` `eval` (and
`eval --codec`) recommends nothing (`too_few`). Not here: eval's run (`rag.evaluation`:
answers as `Corpus.ask` gives them, TTFT timed in rounds), printing (cli/),
generating benchmark data (bench/fidelity_data.py), writing the choice into a corpus (`Corpus.set_recovery`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from rag_promptcache.timing import ratio

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.corpus import Corpus

DEFAULT_NEW_TOKENS = 64  # the answer judged: long enough for a sentence or two, not just its first words
TARGET_RETAINED = 0.95  # the rule (`passes`): a setting's right answers over full prefill's, at least this ...
TARGET_KEPT = 0.90  # ... and of full prefill's right answers, the share it also gets right (paired), at least this
RULE = f"retained >= {TARGET_RETAINED:.2f} and kept >= {TARGET_KEPT:.2f}"  # how reports name it
# Fewer right answers than this under full prefill and a share of them says little (`interval` says how little).
MIN_RIGHT = 30
# Fewer than this and nothing is recommended (`too_few`): even a setting that keeps every one of them could be
# losing more than a quarter of the answers (the 95% interval of 10 of 10 is 0.72-1.00; of 2 of 2, 0.34-1.00).
# Between it and MIN_RIGHT a recommendation comes with a warning.
MIN_TO_RECOMMEND = 10
K = TypeVar("K", bound=Hashable)


def passes(retained: float | None, kept: float | None) -> bool:
    """The rule: retained (right answers over full prefill's) >= `TARGET_RETAINED` and kept (paired: of full
    prefill's right answers, the share the setting also gets right) >= `TARGET_KEPT`. None (not measurable)
    fails. Over several rows (k, splits, draws) a setting passes where every row does: pass the worst of each."""
    return retained is not None and kept is not None and retained >= TARGET_RETAINED and kept >= TARGET_KEPT


def fastest_passing(scores: Mapping[K, tuple[float | None, float | None]], speedup: Mapping[K, float | None], *,
                    min_speedup: float = 0.0) -> K | None:
    """Of the settings whose (retained, kept) `passes` and whose speed-up is at least `min_speedup`, the
    fastest; None when none qualifies. Keys are whatever names a setting (a recovery, or mode and recovery).
    A speed-up that could not be measured (None: a TTFT below the clock's resolution) counts as none."""
    speed = {s: speedup.get(s) or 0.0 for s in scores}
    met = [s for s, (retained, kept) in scores.items() if passes(retained, kept) and speed[s] >= min_speedup]
    return max(met, key=lambda s: speed[s]) if met else None


@dataclass(frozen=True, slots=True)
class EvalQuestion:
    question: str
    answers: tuple[str, ...] = ()  # an answer stating any one is right; none: agreement with full prefill only

    def __post_init__(self) -> None:
        if isinstance(self.answers, str):
            object.__setattr__(self, "answers", (self.answers,))

    @property
    def expected(self) -> tuple[str, ...] | None:
        return self.answers or None

    def judge(self, text: str) -> bool | None:
        """Whether `text` states one of the expected answers; None when there is none."""
        return any(answer_contains(text, a) for a in self.answers) if self.answers else None


@dataclass(frozen=True, slots=True)
class Reference:
    """One question's prompt and full prefill's answer to it."""

    question: EvalQuestion
    module_ids: tuple[str, ...]
    prompt: str
    text: str
    ttft_s: float
    context_tokens: int
    digest: str = ""  # the prompt's `prompt_digest`; "" where not taken

    @property
    def right(self) -> bool | None:
        return self.question.judge(self.text)


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
    expected: tuple[str, ...] | None
    full: str
    cached: str
    full_right: bool | None
    cached_right: bool | None
    agrees: bool
    prompt: str | None = None  # `prompt_digest` of the prompt both answered: a reference's answers are to the same one

    @property
    def failed(self) -> bool:
        """The cached answer is wrong (with an expected answer), or differs from full prefill's (without)."""
        return self.cached_right is False if self.expected is not None else not self.agrees

    def as_dict(self) -> dict[str, object]:
        return {"question": self.question, "expected": None if self.expected is None else list(self.expected), "full": self.full, "cached": self.cached,
                "full_right": self.full_right, "cached_right": self.cached_right, "agrees": self.agrees,
                **({} if self.prompt is None else {"prompt": self.prompt})}


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
    error: str | None = None  # why the setting could not answer (it is then never recommended)
    speedup_rounds: tuple[float, ...] = ()  # the speed-up of each timing round (`eval`); empty: timed once

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
        if self.error is not None:
            return None
        if not self.num_with_answer:
            return self.agreement
        return self.cached_correct / self.full_correct if self.full_correct else None

    @property
    def kept(self) -> float | None:
        """Paired: of the questions full prefill answers right, the share the cached setting answers right
        too (never above 1, unlike `retained`, which also counts answers only the cache gets right); the
        rule (`passes`) reads both. Agreement when no question has an answer; None when full prefill got
        none right or the setting failed."""
        if self.error is not None:
            return None
        if not self.num_with_answer:
            return self.agreement
        both = sum(bool(r.full_right and r.cached_right) for r in self.results)
        return both / self.full_correct if self.results and self.full_correct else None

    @property
    def meets(self) -> bool:
        """Whether this setting passes the rule (`passes`) at this k."""
        return passes(self.retained, self.kept)

    @property
    def kept_counts(self) -> tuple[int, int]:
        """`kept` as (kept, out of): full prefill's right answers the setting also gets right, and full
        prefill's right answers; without expected answers, the answers that agree, and the questions."""
        if not self.num_with_answer:
            return sum(r.agrees for r in self.results), self.num_questions
        return sum(bool(r.full_right and r.cached_right) for r in self.results), self.full_correct

    @property
    def kept_interval(self) -> tuple[float, float] | None:
        """The 95% (Wilson) interval of `kept`, from `kept_counts`; None when there is nothing to keep or
        the setting failed."""
        return None if self.error is not None else interval(*self.kept_counts)

    @property
    def speedup(self) -> float | None:
        """Full prefill's TTFT over the cached one's; None where the cached one measured zero (below the
        clock's resolution)."""
        return ratio(self.full_ttft_s, self.cached_ttft_s)

    def as_dict(self) -> dict[str, object]:
        return {"recovery": self.recovery, "k": self.k, "questions": self.num_questions,
                "with_answer": self.num_with_answer, "full_correct": self.full_correct,
                "cached_correct": self.cached_correct, "full_accuracy": self.full_accuracy,
                "cached_accuracy": self.cached_accuracy, "retained": self.retained, "kept": self.kept, "agreement": self.agreement,
                "full_ttft_s": self.full_ttft_s,
                "cached_ttft_s": None if self.error else self.cached_ttft_s, "speedup": None if self.error else self.speedup,
                "context_tokens": self.context_tokens, "error": self.error, "kept_counts": list(self.kept_counts),
                "kept_interval": None if self.kept_interval is None else list(self.kept_interval),
                "speedup_rounds": list(self.speedup_rounds)}


def interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The Wilson score interval of the share `successes / n` (95% at the default z), which stays
    inside [0, 1] and is honest at 5/5 (0.57-1.00), where the normal approximation claims 1.00-1.00.
    None for n = 0."""
    if n <= 0:
        return None
    p, z2 = successes / n, z * z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


_NUMBER_WORDS = {w: str(n) for n, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
_NUMBER_WORDS.update({"thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "seventy": "70", "eighty": "80",
                      "ninety": "90", "hundred": "100"})


def normalize_answer(text: str) -> str:
    """The form answers are compared in: lower case, one space between words, no thousands separators
    (1,234 is 1234), number words up to twenty and the tens as digits, "percent", "per cent" and " %"
    as "%", no trailing full stop."""
    flat = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower())
    flat = re.sub(r"\b[a-z]+\b", lambda m: _NUMBER_WORDS.get(m.group(), m.group()), flat)
    flat = re.sub(r"(?<=\d)\s*(?:%|per\s*cent\b|pct\b)", "%", flat)
    return " ".join(flat.split()).rstrip(".")


def answer_contains(text: str, expected: str) -> bool:
    """Whether `text` states `expected` as a whole word or number, compared as `normalize_answer` writes
    both: "7% of salary" states "7 percent", "Seven" states "7", "1,234" states "1234"."""
    want = normalize_answer(expected)
    return bool(want) and re.search(rf"(?<!\w){re.escape(want)}(?!\w)", normalize_answer(text)) is not None


def read_questions(path: str | Path) -> list[EvalQuestion]:
    """JSON lines, each {"question": ..., "answer": optional: a string, a number or a list of them (any one
    stated is right)}; blank lines skipped."""
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
        answers = [] if answer is None else answer if isinstance(answer, list) else [answer]
        if answer is not None and (not answers or any(
                isinstance(a, bool) or not isinstance(a, (str, int, float)) or not str(a).strip() for a in answers)):
            raise ValueError(f"{path}:{n}: answer must be a non-empty string or number, or a list of them, got {answer!r}")
        out.append(EvalQuestion(row["question"], tuple(str(a).strip() for a in answers)))
    if not out:
        raise ValueError(f"{path} holds no questions")
    return out


class Prompt(NamedTuple):
    module_ids: tuple[str, ...]
    text: str
    context_tokens: int
    digest: str = ""  # `prompt_digest`


def module_prompt(corpus: Corpus, question: str, k: int, retrieval: str = "hybrid") -> Prompt:
    """The module ids `Corpus.ask` retrieves for `question` (`retrieval`: its search mode), the prompt it
    writes, their tokens, its digest."""
    ids = tuple(m for m, _ in corpus.search(question, k, mode=retrieval))
    text = corpus.prompt(question, corpus.order(ids))
    return Prompt(ids, text, sum(corpus.table.module(m)[1] for m in ids), prompt_digest(corpus, text))


def prompt_digest(corpus: Corpus, prompt: str) -> str:
    """A short digest of what `prompt` asks of the model, which reports keep per question: the corpus's
    instructions and the prompt without the corpus's own name (each build draws one; the module names are
    digests of the modules' text). Answers judged against another run's are to the same prompt only where
    the digests agree (bench/fidelity_reference.py)."""
    canonical = prompt.replace(f'schema="{corpus.manifest.name}"', "schema")
    return hashlib.sha256(f"{corpus.manifest.instructions}\0{canonical}".encode()).hexdigest()[:16]


def references(
    corpus: Corpus, questions: Iterable[EvalQuestion], k: int, max_new_tokens: int = DEFAULT_NEW_TOKENS,
    stop: tuple[str, ...] = (), retrieval: str = "hybrid",
) -> list[Reference]:
    """Retrieve as `Corpus.ask` does (`module_prompt`) and answer each question by full prefill of the
    prompt's tokens."""
    engine = corpus.prepare()
    out = []
    for q in questions:
        p = module_prompt(corpus, q.question, k, retrieval)
        res = engine.generate(p.text, use_cache=False, max_new_tokens=max_new_tokens, stop=stop)
        out.append(Reference(q, p.module_ids, p.text, res.text, res.ttft_s, p.context_tokens, p.digest))
    return out


def answer(engine: PromptCache, ref: Reference, recovery: str, max_new_tokens: int = DEFAULT_NEW_TOKENS,
           stop: tuple[str, ...] = ()) -> Outcome:
    """One reference's prompt answered from the cache with `recovery`, judged against full prefill's answer:
    a module the store lacks is encoded first (`misses="encode"`), so every module is read as stored."""
    res = engine.generate(ref.prompt, recovery=recovery, misses="encode", max_new_tokens=max_new_tokens, stop=stop)
    right = ref.question.judge(res.text)
    return Outcome(recovery, res.text, right, res.text.strip() == ref.text.strip(), res.ttft_s)


def summarize(recovery: str, k: int, refs: Sequence[Reference], outcomes: Sequence[Outcome]) -> SettingReport:
    assert len(refs) == len(outcomes) > 0, f"{len(refs)=} {len(outcomes)=}"
    answered = [(r, o) for r, o in zip(refs, outcomes) if r.question.answers]
    return SettingReport(
        recovery=recovery, k=k, num_questions=len(refs), num_with_answer=len(answered),
        full_correct=sum(bool(r.right) for r, _ in answered), cached_correct=sum(bool(o.right) for _, o in answered),
        agreement=sum(o.agrees for o in outcomes) / len(outcomes),
        full_ttft_s=statistics.median(r.ttft_s for r in refs), cached_ttft_s=statistics.median(o.ttft_s for o in outcomes),
        context_tokens=sum(r.context_tokens for r in refs) / len(refs),
        results=tuple(QuestionResult(r.question.question, r.question.expected, r.text.strip(), o.text.strip(), r.right,
                                     o.right, o.agrees, r.digest or None) for r, o in zip(refs, outcomes)),
    )


def failed(recovery: str, k: int, refs: Sequence[Reference], error: Exception) -> SettingReport:
    """The report of a setting that raised instead of answering: its error, no answers, no speed-up."""
    answered = [r for r in refs if r.question.answers]
    return SettingReport(
        recovery=recovery, k=k, num_questions=len(refs), num_with_answer=len(answered),
        full_correct=sum(bool(r.right) for r in answered), cached_correct=0, agreement=0.0,
        full_ttft_s=statistics.median(r.ttft_s for r in refs), cached_ttft_s=float("nan"),
        context_tokens=sum(r.context_tokens for r in refs) / len(refs), error=f"{type(error).__name__}: {error}")


def too_few(reference: SettingReport, whose: str = "full prefill") -> str | None:
    """Why no recommendation can rest on these answers, said plainly (`whose`: what answered them, "fp16
    modules" for `eval --codec`), or None where `MIN_TO_RECOMMEND` or more do. The reference's right answers
    are what `kept` is a share of; without expected answers, the questions asked."""
    of = reference.kept_counts[1]
    if of >= MIN_TO_RECOMMEND:
        return None
    if reference.num_with_answer:
        return (f"{whose} answered only {of} of the {reference.num_with_answer} questions with an expected answer "
                f"right, and a recommendation needs at least {MIN_TO_RECOMMEND} right answers to rest on; add "
                "questions with expected answers")
    return (f"only {of} question(s) were asked, and a recommendation needs at least {MIN_TO_RECOMMEND} to rest on "
            "(without expected answers, on agreement with full prefill); ask more")


def recommend(reports: Sequence[SettingReport]) -> SettingReport | None:
    """The setting `fastest_passing` picks among these (one k); None when none passes the rule, or when too
    few answers say so (`too_few`)."""
    if not reports or too_few(reports[0]) is not None:
        return None
    best = fastest_passing({r.recovery: (r.retained, r.kept) for r in reports}, {r.recovery: r.speedup for r in reports})
    return next((r for r in reports if r.recovery == best), None)
