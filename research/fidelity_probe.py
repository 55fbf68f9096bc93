"""Where does answer accuracy go? Recompute chosen token sets and count right answers (docs/FIDELITY.md).

    python -m research.fidelity_probe --questions 12 --k 4 --json out/probe.json

Over the fidelity benchmark's fact questions, with the prompt's modules in retrieval order and
reversed (the relevant module farthest from / next to the question), each probe turns a set of cached
tokens into fresh ones (the same exact single prefill as recovery, `recovery.split`) and counts
right answers: entity-name tokens, fact-value tokens, the first tokens of each module, the relevant
module whole, everything but it. The relevant module is the one the question was written from
(known here, not at request time): the probe measures where fidelity lives, not a usable policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from rag_promptcache.bench.fidelity import CHUNK_TOKENS
from rag_promptcache.bench.fidelity_data import Question, generate
from rag_promptcache.engine import PromptCache, Sampling
from rag_promptcache.engine.prompt.compiler import ROOT
from rag_promptcache.engine.planning.recovery import split
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import answer_contains
from rag_promptcache.store import DiskStore

NUMBER = re.compile(r"\b\d{1,4}\b")


def _spans(pattern: re.Pattern[str] | str, text: str) -> list[tuple[int, int]]:
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    return [m.span() for m in rx.finditer(text)]


def _token_hits(tokenizer, ids: tuple[int, ...], text: str, spans: list[tuple[int, int]]) -> set[int]:
    """Offsets of `ids` (the module's tokens, `text` tokenized) that overlap any character span."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert tuple(enc["input_ids"]) == ids, "module tokens differ from its text's tokens"
    return {i for i, (a, b) in enumerate(enc["offset_mapping"]) if any(a < e and s < b for s, e in spans)}


def probes(corpus: Corpus, q: Question) -> dict[str, Callable[[str, str, int], set[int] | None]]:
    """name → f(module id, module text, num tokens) → token offsets to recompute in that module."""
    tok = corpus.engine.tokenizer
    relevant = lambda m: corpus.source(m) == q.source  # noqa: E731
    person = re.compile(r"(?:engineer|captain|musician|geographer|director|astronomer|was) ([A-Z][a-z]+ [A-Z][a-z]+)")

    def names(m: str, text: str, n: int) -> set[int]:
        name = corpus.source(m).split("/")[1]
        return _token_hits(tok, _ids(corpus, text), text, _spans(re.compile(name, re.IGNORECASE), text))

    def facts(m: str, text: str, n: int) -> set[int]:
        spans = _spans(NUMBER, text) + [mm.span(1) for mm in person.finditer(text)]
        return _token_hits(tok, _ids(corpus, text), text, spans)

    return {
        "none": lambda m, t, n: set(),
        "first_2": lambda m, t, n: set(range(min(2, n))),
        "names_all": names,
        "facts_all": facts,
        "names_facts_all": lambda m, t, n: names(m, t, n) | facts(m, t, n),
        "relevant_facts": lambda m, t, n: facts(m, t, n) if relevant(m) else set(),
        "relevant_names_facts": lambda m, t, n: names(m, t, n) | facts(m, t, n) if relevant(m) else set(),
        "relevant_module": lambda m, t, n: set(range(n)) if relevant(m) else set(),
        "relevant_module+first_2": lambda m, t, n: set(range(n)) if relevant(m) else set(range(min(2, n))),
        "all_but_relevant": lambda m, t, n: set() if relevant(m) else set(range(n)),
        "everything": lambda m, t, n: set(range(n)),
    }


def _ids(corpus: Corpus, text: str) -> tuple[int, ...]:
    return corpus.engine.compiler.tokenize(text)


def answer(engine: PromptCache, prompt: str, chosen_for: Callable[[str, int], set[int]], max_new: int) -> str:
    """Generate with the cached tokens `chosen_for(module, offset set)` recomputed, via recovery.split."""
    plan = engine.plan(prompt, recovery="none")
    chosen: set[int] = set()
    seq = 0
    for p in plan.pieces:
        if p.cached and p.unit != ROOT:
            offs = chosen_for(p.unit, len(plan.kvs[p.unit].token_ids))
            chosen.update(seq + o - p.offset for o in offs if p.offset <= o < p.offset + len(p.token_ids))
        seq += len(p.token_ids)
    plan = dataclasses.replace(plan, pieces=tuple(split(plan.pieces, chosen)))
    return engine.stream_plan(plan, Sampling(max_new_tokens=max_new)).consume().text


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=12)
    ap.add_argument("--k", type=int, nargs="+", default=[4])
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--probes", default="", help="comma-separated subset [default: all]")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path, help="keep the corpus and its KV here between runs [default: a temp dir]")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    data = generate()
    qs = [q for q in data.questions if q.shape == "fact"][: args.questions]
    out: dict[str, object] = {"questions": len(qs), "new_tokens": args.new_tokens, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        where = args.workdir or Path(tmp)
        engine = PromptCache.from_pretrained("smollm2-135m-instruct", store=DiskStore(where / "kv"))
        corpus = Corpus.build(data.documents, where / "c", engine=engine, chunk_tokens=CHUNK_TOKENS, progress=False)
        corpus.prepare()
        texts = {m: t for m, t in corpus.table.modules()}
        for k in args.k:
            counts: dict[tuple[str, str], int] = {}
            for q in qs:
                ids = [m for m, _ in corpus.search(q.question, k)]
                rank = next((i for i, m in enumerate(ids) if corpus.source(m) == q.source), None)
                for order, mods in (("retrieval", ids), ("reversed", ids[::-1])):
                    prompt = corpus.prompt(q.question, mods)
                    full = engine.generate(prompt, use_cache=False, max_new_tokens=args.new_tokens).text
                    counts[(order, "full_prefill")] = counts.get((order, "full_prefill"), 0) + answer_contains(full, q.answer)
                    for name, pick in probes(corpus, q).items():
                        if args.probes and name not in args.probes.split(","):
                            continue
                        text = answer(engine, prompt, lambda m, n: pick(m, texts[m], n), args.new_tokens)
                        counts[(order, name)] = counts.get((order, name), 0) + answer_contains(text, q.answer)
                print(f"k={k} {q.question} rank={rank} " + " ".join(f"{o[0]}:{n}={c}" for (o, n), c in counts.items()),
                      flush=True)
            for (order, name), c in counts.items():
                out["rows"].append({"k": k, "order": order, "probe": name, "right": c, "questions": len(qs)})
        corpus.close()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    for r in out["rows"]:
        print(f"k={r['k']:>2} {r['order']:<9} {r['probe']:<26} {r['right']}/{r['questions']}")
    return out


if __name__ == "__main__":
    main()
