"""`rag-promptcache eval`'s run: every question answered the way the corpus answers it, with full
prefill and with each recovery setting, and the time to the first token measured in rounds.

- Answers come from `Corpus.ask` itself (`use_cache=False` for full prefill, `recovery=` for a
  setting): the same retrieval, prompt and repetition control (`rag.repetition.answer_options`) that
  `ask`, `chat` and the adapters give a user, so what is judged is what they get.
- TTFT is timed apart from the answers, one token at a time: per round, each question's full
  prefill and then every setting back to back, so the times a speed-up divides are taken under the
  same load. Every prompt is computed as the first time: the engine's prefix cache is off while
  timing (`fresh_prefills`), else a repeat would be answered from it with no prefill at all. The
  speed-up is the ratio of the medians over every round; `SettingReport.speedup_rounds` holds each
  round's own, which says how stable it is.

Not here: judging and the rule (`rag.fidelity`), printing (cli/eval_cmd.py).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_promptcache.engine.prefix.prefix_cache import NullPrefixCache
from rag_promptcache.timing import ratio
from rag_promptcache.rag.fidelity import (DEFAULT_NEW_TOKENS, EvalQuestion, Outcome, Reference, SettingReport, failed,
                                          summarize)

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.corpus import Corpus

TIMING_ROUNDS = 3  # rounds of TTFT timings per question and setting: a median, and a spread to show


@dataclass(frozen=True, slots=True)
class Timings:
    """Seconds to the first token, per round and question: full prefill's and each setting's."""

    full: tuple[tuple[float, ...], ...]
    cached: dict[str, tuple[tuple[float, ...], ...]]

    def speedup_rounds(self, setting: str) -> tuple[float, ...]:
        """Each round's speed-up (median full over median cached); a round whose cached median is below
        the clock's resolution (zero) says nothing and is left out."""
        rounds = (ratio(statistics.median(full), statistics.median(cached))
                  for full, cached in zip(self.full, self.cached[setting]))
        return tuple(r for r in rounds if r is not None)


def evaluate(
    corpus: Corpus,
    questions: Sequence[EvalQuestion],
    recoveries: Sequence[str],
    k: int = 4,
    max_new_tokens: int = DEFAULT_NEW_TOKENS,
    rounds: int = TIMING_ROUNDS,
) -> list[SettingReport]:
    """Full prefill's answer once per question, then every recovery setting's, each as `Corpus.ask`
    gives it, and TTFT timed in `rounds`: one report per setting. A setting the engine refuses
    (ValueError) or that fails in the model (RuntimeError) is reported as failed, with its error, and
    is not timed; the others still run."""
    from rag_promptcache.engine.planning.recovery import Recovery

    if not questions:
        raise ValueError("no questions to evaluate")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    specs = [str(Recovery.parse(r)) for r in recoveries]  # bad specs fail before any model work
    refs = [full_answer(corpus, q, k, max_new_tokens) for q in questions]
    reports: dict[str, SettingReport] = {}
    for s in specs:
        try:
            reports[s] = summarize(s, k, refs, [cached_answer(corpus, r, s, k, max_new_tokens) for r in refs])
        except (ValueError, RuntimeError) as e:  # not swallowed: the report carries it to the user
            reports[s] = failed(s, k, refs, e)
    answered = [s for s in specs if reports[s].error is None]
    timings = time_settings(corpus.prepare(), [r.prompt for r in refs], answered, rounds)
    full = [t for round_ in timings.full for t in round_]
    return [reports[s] if reports[s].error is not None else dataclasses.replace(
        reports[s], full_ttft_s=statistics.median(full),
        cached_ttft_s=statistics.median(t for round_ in timings.cached[s] for t in round_),
        speedup_rounds=timings.speedup_rounds(s)) for s in specs]


def full_answer(corpus: Corpus, question: EvalQuestion, k: int, max_new_tokens: int) -> Reference:
    """`question` asked as `ask` asks it, answered by full prefill of the prompt's tokens."""
    a = corpus.ask(question.question, k, max_new_tokens=max_new_tokens, use_cache=False)
    context = sum(corpus.table.module(m)[1] for m in a.module_ids)
    return Reference(question, a.module_ids, a.prompt, a.answer, a.ttft_s, context)


def cached_answer(corpus: Corpus, ref: Reference, recovery: str, k: int, max_new_tokens: int) -> Outcome:
    """`ref`'s question asked as `ask` asks it, answered from the cache with `recovery`, judged."""
    a = corpus.ask(ref.question.question, k, max_new_tokens=max_new_tokens, recovery=recovery)
    return Outcome(recovery, a.answer, ref.question.judge(a.answer), a.answer.strip() == ref.text.strip(), a.ttft_s)


def time_settings(engine: PromptCache, prompts: Sequence[str], settings: Sequence[str], rounds: int) -> Timings:
    """TTFT (one token) of each prompt by full prefill and by each setting, `rounds` times, every
    prompt computed as the first time; one untimed pass of each path first, so none is timed cold."""
    full: list[tuple[float, ...]] = []
    cached: dict[str, list[tuple[float, ...]]] = {s: [] for s in settings}
    with fresh_prefills(engine):
        engine.generate(prompts[0], use_cache=False, max_new_tokens=1)
        for s in settings:
            engine.generate(prompts[0], recovery=s, max_new_tokens=1)
        for _ in range(rounds):
            times: dict[str, list[float]] = {s: [] for s in ("", *settings)}  # "": full prefill
            for prompt in prompts:
                times[""].append(engine.generate(prompt, use_cache=False, max_new_tokens=1).ttft_s)
                for s in settings:
                    times[s].append(engine.generate(prompt, recovery=s, max_new_tokens=1).ttft_s)
            full.append(tuple(times[""]))
            for s in settings:
                cached[s].append(tuple(times[s]))
    return Timings(tuple(full), {s: tuple(v) for s, v in cached.items()})


@contextmanager
def fresh_prefills(engine: PromptCache) -> Iterator[None]:
    """The engine's prefix cache off for the block (what it held comes back after), so that a prompt
    timed again is computed again rather than answered from the previous time. Not while the engine
    serves other requests."""
    kept = getattr(engine, "prefix_cache", None)
    if kept is None:  # an engine without one (a test's stand-in): nothing to turn off
        yield
        return
    engine.prefix_cache = NullPrefixCache()
    try:
        yield
    finally:
        engine.prefix_cache = kept
