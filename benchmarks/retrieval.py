"""Retrieval on real manuals: does retrieval find the chunk that answers, and do the answers come right?

- **Real documents** (benchmarks/retrieval_data.py): 22 pages of SQLite's and Git's manuals, ingested as a
  user would (HTML main text, the real embedder), and 63 questions checked in their text. For the dense
  (FAISS), lexical (BM25) and hybrid (fused, the default) rankings: recall@1/4/8 (the share of questions
  whose answer-bearing module is in the top k) and MRR (over the top 8); and, hybrid, with each question's
  search filtered to its manual and to its page (`Corpus.search(filter=...)`, retrieval_data.scopes).
- **Look-alike splits** (bench/fidelity_*.py: confusable records, reports, manuals): the same rows, so
  hybrid retrieval is seen not to lose where documents differ only in names and numbers.
- **Answers** on the real documents at k = 4 (hybrid), every other question: right answers of the engine's full prefill and
  of its default cached path, and how many answers copy a source label (`[page.html]`), the context
  line a module may carry, or a navigation line.
- **Latency** at 10k and 100k modules: the real modules plus synthetic filler (word sequences drawn from
  the real modules' words, random unit vectors: only the time is measured there), per mode, the
  question's embedding included and apart; and how long the lexical index takes to build.

Not here: which module answers a question (retrieval_data.py), retrieval itself (rag/retrieval.py).
"""

from __future__ import annotations

import random
import re
import tempfile
import threading
from pathlib import Path

import numpy as np

from benchmarks import retrieval_data
from rag_promptcache.bench import fidelity
from rag_promptcache.bench.common import Bench, median, timed
from rag_promptcache.bench.tables import table
from rag_promptcache.engine import PromptCache
from rag_promptcache.rag import retrieval
from rag_promptcache.rag.chunker import SEPARATOR, module_id
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import EvalQuestion, answer, references
from rag_promptcache.rag.html import is_navigation
from rag_promptcache.rag.index import VectorIndex, faiss_id
from rag_promptcache.rag.lexical import LexicalIndex
from rag_promptcache.rag.table import ChunkTable, ModuleRow
from rag_promptcache.store import MemoryStore
from rag_promptcache.timing import repeat

KS = (1, 4, 8)
ANSWER_K = 4
ANSWER_EVERY = 2  # the answers are asked for every n-th question
NEW_TOKENS = 40  # room for a sentence; options and numbers come first
STOP = ("\n\n",)
SCALES = (10_000, 100_000)
LATENCY_QUESTIONS = 20
TARGETS = {"recall@4": 0.9, "recall@8": 0.97, "p50_ms_at_10k": 20.0}
_LABEL = re.compile(r"\[[^\]\n]{1,200}\.(?:html?|md|markdown|txt|rst|pdf|jsonl?)\]", re.I)


def run(bench: Bench, quick: bool | None = None) -> dict[str, object]:
    quick = bench.config.questions < 24 if quick is None else quick  # BenchConfig.quick() asks 20
    pages, questions = retrieval_data.load()
    out: dict[str, object] = {"targets": TARGETS}
    with tempfile.TemporaryDirectory(prefix="rpc-retrieval-") as tmp:
        engine = PromptCache(bench.model, bench.tokenizer, store=MemoryStore(), name=bench.model_name)
        corpus = Corpus.build([p for ps in pages.values() for p in ps], f"{tmp}/manuals", engine=engine, progress=False)
        bench.log(f"retrieval: {sum(map(len, pages.values()))} pages, {len(corpus)} modules, "
                  f"{corpus.last_report.num_tokens} tokens, {len(questions)} questions")
        texts = retrieval_data.by_source(corpus)
        relevant = [retrieval_data.gold(texts, q) for q in questions]
        out["unanswerable"] = [q.question for q, r in zip(questions, relevant) if not r]
        out["real"] = recall_rows(corpus, [q.question for q in questions], relevant, "manuals")
        out["filtered"] = [row for scope, filters in retrieval_data.scopes(pages, questions).items()
                           for row in recall_rows(corpus, [q.question for q in questions], relevant,
                                                  f"manuals within the {scope}", filters, ("hybrid",))]
        for row in [*out["real"], *out["filtered"]]:
            bench.log(_line(row))
        # every other question (every fourth in a quick run): both manuals, at half the generation time
        step = ANSWER_EVERY * (2 if quick else 1)
        out["answers"] = answers(corpus, engine, questions[::step], relevant[::step])
        bench.log(f"retrieval answers: {out['answers']}")
        out["latency"] = latency(bench, corpus, [q.question for q in questions[:LATENCY_QUESTIONS]],
                                 SCALES[:1] if quick else SCALES, Path(tmp))
        for row in out["latency"]:
            bench.log(f"retrieval latency at {row['modules']} modules, {row['mode']}: p50 {row['p50_ms']:.1f} ms")
        corpus.close()
        out["lookalike"] = []
        for split in fidelity.SPLITS:
            out["lookalike"] += lookalike(bench, split, Path(tmp))
        for row in out["lookalike"]:
            bench.log(_line(row))
    return out


def _line(row: dict[str, object]) -> str:
    return (f"retrieval {row['set']} {row['mode']}: " + ", ".join(f"recall@{k} {row[f'recall@{k}']:.2f}" for k in KS)
            + f", MRR {row['mrr']:.2f} ({row['questions']} questions)")


def recall_rows(corpus: Corpus, questions: list[str], relevant: list[set[str]], name: str,
                filters: list[dict[str, object] | None] | None = None,
                modes: tuple[str, ...] = retrieval.MODES) -> list[dict[str, object]]:
    """Per mode: recall@k and MRR over the questions that have an answer-bearing module, and the misses
    at k = 4 (question, what came first). `filters`: each question's search is within its own."""
    rows = []
    kept = [(q, r, f) for q, r, f in zip(questions, relevant, filters or [None] * len(questions)) if r]
    for mode in modes:
        found = [[m for m, _ in corpus.search(q, max(KS), mode, filter=f)] for q, _, f in kept]
        rank = [retrieval_data.ranks(f, r) for f, (_, r, _) in zip(found, kept)]
        n = max(1, len(kept))
        rows.append({"set": name, "mode": mode, "questions": len(kept),
                     **{f"recall@{k}": sum(1 for x in rank if x is not None and x <= k) / n for k in KS},
                     "mrr": sum(1 / x for x in rank if x is not None) / n,
                     "missed@4": [{"question": q, "first": corpus.label(f[0]) if f else None}
                                  for (q, _, _), f, x in zip(kept, found, rank) if x is None or x > 4]})
    return rows


def leaks(text: str, labels: set[str]) -> dict[str, bool]:
    """What an answer copied from the prompt's furniture: a source label, the context line, navigation."""
    return {"label": bool(_LABEL.search(text)) or any(label in text for label in labels),
            "context": SEPARATOR.strip() in text,
            "navigation": any(is_navigation(line) for line in text.splitlines() if line.strip())}


def answers(corpus: Corpus, engine: PromptCache, questions: list[retrieval_data.RealQuestion],
            relevant: list[set[str]]) -> dict[str, object]:
    """Full prefill and the default cached path on the same prompts (k = ANSWER_K, hybrid retrieval)."""
    asked = [EvalQuestion(q.question, q.answers) for q in questions]
    refs = references(corpus, asked, ANSWER_K, NEW_TOKENS, STOP)
    default = str(engine.recovery)
    cached = [answer(engine, r, default, NEW_TOKENS, STOP) for r in refs]
    labels = {d.label for d in corpus.table.documents()}
    out: dict[str, object] = {"k": ANSWER_K, "recovery": default, "questions": len(refs),
                              "retrieved": sum(bool(set(r.module_ids) & g) for r, g in zip(refs, relevant)),
                              "full_right": sum(bool(r.right) for r in refs),
                              "cached_right": sum(bool(o.right) for o in cached)}
    for what in ("label", "context", "navigation"):
        out[f"full_{what}"] = sum(leaks(r.text, labels)[what] for r in refs)
        out[f"cached_{what}"] = sum(leaks(o.text, labels)[what] for o in cached)
    out["examples"] = [{"question": r.question.question, "full": r.text.strip(), "cached": o.text.strip(),
                        "full_right": bool(r.right), "cached_right": bool(o.right)} for r, o in zip(refs, cached)]
    return out


def latency(bench: Bench, corpus: Corpus, questions: list[str], scales: tuple[int, ...], tmp: Path) -> list[dict[str, object]]:
    """Per scale and mode, the median over the questions of one `retrieval.search` (embedding included),
    the embedding's own median, and the lexical index's build time."""
    ids, texts, headings = corpus.table.search_texts()
    _, vectors = corpus.table.vectors(corpus.manifest.dim)
    vocabulary = " ".join(texts).split()
    embed = median([timed(lambda q=q: corpus.embedder.embed([q]), bench.device, bench.min_span_s)[0] for q in questions])
    rows = []
    for n in scales:
        table, index, lexical, build_s = _scaled(corpus, ids, texts, headings, vectors, vocabulary, n, tmp)
        lock = threading.RLock()
        for mode in retrieval.MODES:
            per = [timed(lambda q=q: retrieval.search(index, lexical, lock, corpus.embedder, table, q, ANSWER_K, mode),
                         bench.device, bench.min_span_s)[0] for q in questions]
            rows.append({"modules": n, "mode": mode, "p50_ms": 1000 * median(per), "max_ms": 1000 * max(per),
                         "embed_p50_ms": 1000 * embed, "lexical_build_s": build_s, "synthetic": n - len(ids)})
        table.close()
    return rows


def _scaled(corpus: Corpus, ids: np.ndarray, texts: list[str], headings: list[str], vectors: np.ndarray,
            vocabulary: list[str], n: int, tmp: Path) -> tuple[ChunkTable, VectorIndex, LexicalIndex, float]:
    """The real modules plus synthetic ones up to `n`: a chunk table, a flat FAISS index, a BM25 index."""
    rng, gen = random.Random(n), np.random.default_rng(n)
    table = ChunkTable(tmp / f"scale-{n}.sqlite")
    fill = [" ".join(rng.choices(vocabulary, k=180)) for _ in range(n - len(ids))]
    noise = gen.standard_normal((len(fill), corpus.manifest.dim), dtype=np.float32)
    noise /= np.linalg.norm(noise, axis=1, keepdims=True)
    names = [m for m, _ in corpus.table.modules()] + [module_id(f"filler {i} {t}") for i, t in enumerate(fill)]
    all_vectors = np.concatenate([vectors, noise])
    all_texts = [*texts, *fill]
    rows = [ModuleRow(m, faiss_id(m), t, 0, v) for m, t, v in zip(names, all_texts, all_vectors)]
    for start in range(0, len(rows), 10_000):
        table.commit_batch(rows[start:start + 10_000], [], [])
    all_ids = np.array([r.faiss_id for r in rows], dtype=np.int64)
    index = VectorIndex(corpus.manifest.dim, "flat")
    index.add(all_ids, all_vectors)
    built = repeat(lambda: LexicalIndex(all_ids, all_texts, [*headings, *[""] * len(fill)]), 0.0)
    return table, index, built.result, built.seconds


def lookalike(bench: Bench, split: str, tmp: Path) -> list[dict[str, object]]:
    """Recall rows on a fidelity split's corpus, built as the fidelity scenario builds it."""
    data, chunk = fidelity.split_data(split, bench.config.fidelity_per_kind, bench.config.fidelity_seed_offset)
    engine = PromptCache(bench.model, bench.tokenizer, store=MemoryStore(), name=bench.model_name)
    corpus = Corpus.build(data.documents, tmp / f"lookalike-{split}", engine=engine, chunk_tokens=chunk, progress=False)
    texts = retrieval_data.by_source(corpus)
    questions = data.questions[: bench.config.fidelity_questions]
    relevant = [retrieval_data.gold(texts, retrieval_data.RealQuestion(q.question, (q.answer,), q.source)) for q in questions]
    rows = recall_rows(corpus, [q.question for q in questions], relevant, f"lookalike-{split}")
    corpus.close()
    return rows


def markdown(out: dict[str, object]) -> str:
    """The run's tables: recall per set and mode, the answers, the latency."""
    ks = (1, 4, 8)
    rows = [*out["real"], *out["lookalike"]]
    lines = ["## Retrieval (recall of the answer-bearing module, real manuals and look-alike splits)", "",
             table(["set", "mode", "questions", *(f"recall@{k}" for k in ks), "MRR"],
                   [[r["set"], r["mode"], r["questions"], *(r[f"recall@{k}"] for k in ks), r["mrr"]] for r in rows]), ""]
    a = out["answers"]
    lines += [f"Answers at k = {a['k']} (hybrid) on {a['questions']} questions, the answer-bearing module retrieved for "
              f"{a['retrieved']}: full prefill {a['full_right']} right, the default cached path ({a['recovery']}) "
              f"{a['cached_right']}; answers copying a source label {a['full_label']} / {a['cached_label']}, the context "
              f"line {a['full_context']} / {a['cached_context']}, navigation {a['full_navigation']} / {a['cached_navigation']}.", ""]
    lines += ["Retrieval latency (one question, its embedding included; synthetic filler beyond the real modules)", "",
              table(["modules", "mode", "p50 ms", "max ms", "embedding p50 ms", "BM25 build s"],
                    [[r["modules"], r["mode"], r["p50_ms"], r["max_ms"], r["embed_p50_ms"], r["lexical_build_s"]]
                     for r in out["latency"]]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, object]:
    from benchmarks import harness

    args = harness.parser("Recall, answers and latency of retrieval on SQLite's and Git's manuals (`make manuals`) "
                          "and the look-alike splits: retrieval.json and retrieval.md in --out.").parse_args(argv)
    bench = harness.load(args)
    out = run(bench, args.quick)
    return harness.write(bench, args.quick, args.out, "retrieval", out, markdown(out))


if __name__ == "__main__":
    main()
