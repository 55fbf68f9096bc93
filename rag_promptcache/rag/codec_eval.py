"""What a KV codec does to answers: the same questions over modules decoded from each codec, judged
against the same modules in fp16 (`eval --codec`, the bench's fidelity scenario's codec rows).

Every module the questions retrieve is encoded once, exactly (a native store), then put into one
memory store per codec; an engine per codec over the same model reads only from its store, with
the same recovery, no fallback to full prefill and no prefix cache, so each answer is the codec's.
Per question the fp16 answer and each codec's run back to back. A codec is judged as a recovery is
(`SettingReport`): `retained` (right answers over fp16's) and `kept` (paired: of fp16's right answers,
the share the codec also gets right); `recommend_codec` takes the fewest bytes per token among those
passing the rule (`fidelity.passes`), and nothing where fp16 answered too few right (`fidelity.too_few`,
as `eval` for a recovery).

Not here: choosing a recovery (`fidelity.py`), the codecs themselves (`rag_promptcache.store`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rag_promptcache.rag.fidelity import (DEFAULT_NEW_TOKENS, EvalQuestion, Outcome, Prompt, Reference, SettingReport,
                                          answer, module_prompt, summarize, too_few)

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.pml import ast
    from rag_promptcache.rag.corpus import Corpus

REFERENCE_CODEC = "fp16"  # what every codec is judged against
REFERENCE_WHOSE = "fp16 modules"  # how the reference's answers are named to a user


@dataclass(frozen=True, slots=True)
class CodecReport:
    """One codec over all questions at one k, against fp16 modules (`report.full_*` are fp16's)."""

    codec: str
    recovery: str
    bytes_per_token: float  # as its memory store holds the modules
    report: SettingReport

    @property
    def meets(self) -> bool:
        return self.report.meets

    def as_dict(self) -> dict[str, object]:
        return {**self.report.as_dict(), "codec": self.codec, "recovery": self.recovery,
                "bytes_per_token": self.bytes_per_token, "meets": self.meets,
                "fp16_correct": self.report.full_correct}


def recommend_codec(reports: Sequence[CodecReport]) -> CodecReport | None:
    """The fewest bytes per token among the codecs that meet the targets against fp16 modules; None where
    none does, or where fp16's own right answers are too few to judge by (`fidelity.too_few`, as `eval`)."""
    if not reports or too_few(reports[0].report, REFERENCE_WHOSE) is not None:
        return None
    met = [r for r in reports if r.meets]
    return min(met, key=lambda r: r.bytes_per_token) if met else None


class CodecEngines:
    """One engine per codec (and fp16) over the same model, each store holding the same modules."""

    def __init__(self, source: PromptCache, schema: ast.Schema, codecs: Sequence[str]) -> None:
        from rag_promptcache.engine import PromptCache
        from rag_promptcache.store import MemoryStore, check_codec

        self.schema = schema.name
        self.codecs = tuple(dict.fromkeys([REFERENCE_CODEC, *(check_codec(c) for c in codecs)]))
        self.exact = PromptCache(source.model, source.tokenizer, store=MemoryStore(max_bytes=None), mode=source.mode,
                                 name=source.model_name, fallback="never", prefix_cache_bytes=0)
        self.exact.add_schema(schema)
        self.engines = {c: PromptCache(source.model, source.tokenizer, store=MemoryStore(max_bytes=None, codec=c),
                                       mode=source.mode, name=source.model_name, fallback="never", prefix_cache_bytes=0)
                        for c in self.codecs}
        for e in self.engines.values():
            e.add_schema(schema)
        self._held: set[str] = set()

    def hold(self, module_ids: Sequence[str]) -> None:
        """Encode the modules not held yet, exactly, and put them into every codec's store."""
        todo = [m for m in dict.fromkeys(module_ids) if m not in self._held]
        if not todo:
            return
        self.exact.encode(self.schema, todo)
        keys = self.exact.store_keys(self.schema, todo)
        for m in todo:
            kv = self.exact.store.get(keys[m])
            assert kv is not None, f"{m=}"
            for e in self.engines.values():
                e.store.put(keys[m], kv)
            self.exact.store.delete(keys[m])
        self._held.update(todo)

    def bytes_per_token(self, codec: str) -> float:
        return self.engines[codec].store.stats().bytes_per_token

    def close(self) -> None:
        for e in (self.exact, *self.engines.values()):
            e.store.close()


def answer_codecs(engines: CodecEngines, prompt: Prompt, question: EvalQuestion, recovery: str,
                  max_new_tokens: int, stop: tuple[str, ...] = ()) -> tuple[Reference, dict[str, Outcome]]:
    """One question: fp16's answer (the reference), then every codec's, fp16's own included (its
    outcome is the reference's, so its report shows its bytes beside the others), back to back."""
    engines.hold(prompt.module_ids)
    res = engines.engines[REFERENCE_CODEC].generate(prompt.text, recovery=recovery, max_new_tokens=max_new_tokens,
                                                   stop=stop)
    ref = Reference(question, prompt.module_ids, prompt.text, res.text, res.ttft_s, prompt.context_tokens)
    out = {REFERENCE_CODEC: Outcome(recovery, res.text, question.judge(res.text), True, res.ttft_s)}
    out.update({c: answer(e, ref, recovery, max_new_tokens, stop) for c, e in engines.engines.items()
                if c != REFERENCE_CODEC})
    return ref, out


def evaluate_codecs(corpus: Corpus, questions: Sequence[EvalQuestion], codecs: Sequence[str], recovery: str,
                    k: int = 4, max_new_tokens: int = DEFAULT_NEW_TOKENS, stop: tuple[str, ...] = (),
                    engines: CodecEngines | None = None, retrieval: str = "hybrid") -> list[CodecReport]:
    """Each codec's answers against fp16 modules' over `questions`, with `recovery`: one report per
    codec, fp16's first. `engines` (the caller's, kept open: the bench asks at several k) or new ones."""
    if not questions:
        raise ValueError("no questions to evaluate")
    own = engines is None
    engines = engines or CodecEngines(corpus.prepare(), corpus.schema, codecs)
    try:
        prompts = [module_prompt(corpus, q.question, k, retrieval) for q in questions]
        warm_up(engines, prompts[0], recovery)
        refs: list[Reference] = []
        outcomes: dict[str, list[Outcome]] = {c: [] for c in engines.codecs}
        for q, p in zip(questions, prompts):
            ref, out = answer_codecs(engines, p, q, recovery, max_new_tokens, stop)
            refs.append(ref)
            for c, o in out.items():
                outcomes[c].append(o)
        return [CodecReport(c, recovery, engines.bytes_per_token(c), summarize(c, k, refs, outcomes[c]))
                for c in outcomes]
    finally:
        if own:
            engines.close()


def warm_up(engines: CodecEngines, prompt: Prompt, recovery: str) -> None:
    """Every engine once on `prompt` before anything is timed: no cold first timing, and the schema's
    own text (the instructions) is stored in every codec before it is measured."""
    engines.hold(prompt.module_ids)
    for e in engines.engines.values():
        e.generate(prompt.text, recovery=recovery, max_new_tokens=1)
