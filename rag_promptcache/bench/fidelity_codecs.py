"""The fidelity scenario's codec rows: per split and k, each codec's answers against fp16 modules'
(rag/codec_eval.py), with `BenchConfig.fidelity_codec_recovery` (None: the engine's default).

Not here: the recovery rows and the rules over them (fidelity.py), the codecs (rag_promptcache.store).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rag_promptcache.bench.fidelity_reference import adapter_label
from rag_promptcache.engine.planning.recovery import Recovery
from rag_promptcache.rag.codec_eval import CodecEngines, evaluate_codecs
from rag_promptcache.rag.fidelity import EvalQuestion

if TYPE_CHECKING:
    from rag_promptcache.bench.common import Bench
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.corpus import Corpus

STOP = (".",)  # as the recovery rows: the answer is its first sentence


def rows(bench: Bench, split: str, corpus: Corpus, engine: PromptCache,
         questions: list[EvalQuestion]) -> list[dict[str, object]]:
    """Per k, each codec's answers against fp16 modules' (rag/codec_eval.py), with the configured recovery."""
    cfg = bench.config
    recovery = str(Recovery.parse(cfg.fidelity_codec_recovery or engine.recovery))
    engines = CodecEngines(engine, corpus.schema, cfg.fidelity_codecs)
    out: list[dict[str, object]] = []
    try:
        for k in cfg.fidelity_ks:
            for r in evaluate_codecs(corpus, questions, cfg.fidelity_codecs, recovery, k, cfg.fidelity_new_tokens, STOP,
                                     engines, cfg.fidelity_retrieval):
                out.append({"split": split, "adapter": adapter_label(bench.model), "mode": engine.mode,
                             **r.as_dict(), "answers": [a.as_dict() for a in r.report.results]})
                bench.log(f"fidelity {split} k={k} codec {r.codec} ({r.bytes_per_token:.0f} B/token), {recovery}: "
                          f"fp16 modules {r.report.full_correct}/{r.report.num_with_answer}, codec {r.report.cached_correct}, "
                          f"kept {_fmt(r.report.kept)}, retained {_fmt(r.report.retained)}")
    finally:
        engines.close()
    return out


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"
