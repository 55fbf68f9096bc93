"""Hybrid retrieval with and without the ranking by identifiers named in headings (`retrieval.NAMES_WEIGHT`):
recall@1/4/8 and MRR on the retrieval bench's manuals (63 questions) and on the Node.js API reference
(nodejs's /usr/share/doc/nodejs/api/*.md, all 64 pages ingested with `--kv lazy`): the 16 questions of the
Dec 2 measurement, and questions drawn from the reference's API headings ("What does events.once return?").

    PYTHONPATH=. python docs/bench/heading-names-2026-12-03/run.py NODE_CORPUS MANUALS_CORPUS OUT.json
"""
import ast
import json
import random
import re
import sys
from pathlib import Path

from benchmarks import retrieval_data
from rag_promptcache.rag import retrieval
from rag_promptcache.rag.chunker import SEPARATOR
from rag_promptcache.rag.corpus import Corpus

API = Path("/usr/share/doc/nodejs/api")
SEED, DRAWN = 20261203, 120
# the Dec 2 measurement's questions and the heading each names, read from its script
_DEC2 = Path(__file__).resolve().parents[1] / "heading-weight-2026-12-02" / "nodejs.py"
HAND = next(ast.literal_eval(node.value) for node in ast.parse(_DEC2.read_text()).body
            if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "QS")
_API = re.compile(r"`((?:new )?[A-Za-z_$][\w$]*(?:\.[A-Za-z_$][\w$]*)+)(\([^`]*\))?`")


def node_questions(corpus: Corpus) -> dict[str, list[tuple[str, set[str]]]]:
    rows = corpus.table.db.execute("SELECT module_id, context FROM modules").fetchall()
    parts = {m: (c or "").split(SEPARATOR) for m, c in rows}
    under = lambda heading: {m for m, p in parts.items() if heading in p}  # noqa: E731 - its section and subsections
    hand = [(q, {m for m, p in parts.items() if any(h in x for x in p)}) for q, h in HAND]
    headings = sorted({p[-1] for p in parts.values() if (m := _API.match(p[-1])) and m.end() == len(p[-1])})
    drawn = []
    for heading in random.Random(SEED).sample(headings, min(DRAWN, len(headings))):
        name, call = _API.match(heading).groups()
        drawn.append((f"What does {name.removeprefix('new ')} {'return' if call else 'mean'}?", under(heading)))
    return {"Node.js, the Dec 2 questions": hand, f"Node.js, {DRAWN} drawn from its API headings": drawn}


def rows(corpus: Corpus, sets: dict[str, list[tuple[str, set[str]]]]) -> list[dict[str, object]]:
    out = []
    for name, questions in sets.items():
        for weight in (0.0, retrieval.NAMES_WEIGHT):
            retrieval.NAMES_WEIGHT, shipped = weight, retrieval.NAMES_WEIGHT
            ranks = []
            for question, gold in questions:
                found = [m for m, _ in corpus.search(question, 8)]
                ranks.append(next((i + 1 for i, m in enumerate(found) if m in gold), None))
            retrieval.NAMES_WEIGHT = shipped
            n = len(questions)
            row = {"set": name, "names_weight": weight, "questions": n,
                   **{f"recall@{k}": sum(1 for r in ranks if r and r <= k) / n for k in (1, 4, 8)},
                   "mrr": sum(1 / r for r in ranks if r) / n,
                   "missed@4": [q for (q, _), r in zip(questions, ranks) if not r or r > 4]}
            print(json.dumps({k: v for k, v in row.items() if k != "missed@4"}), flush=True)
            out.append(row)
    return out


if __name__ == "__main__":
    node_path, manuals_path, out_path = map(Path, sys.argv[1:4])
    node = Corpus.open(node_path)
    result = rows(node, node_questions(node))
    pages, questions = retrieval_data.load()
    manuals = (Corpus.open(manuals_path) if manuals_path.exists() else
               Corpus.build([p for ps in pages.values() for p in ps], manuals_path, kv="lazy", progress=False))
    texts = retrieval_data.by_source(manuals)
    manual_set = [(q.question, retrieval_data.gold(texts, q)) for q in questions]
    result += rows(manuals, {"SQLite and Git manuals": [(q, g) for q, g in manual_set if g]})
    out_path.write_text(json.dumps(result, indent=1) + "\n")
