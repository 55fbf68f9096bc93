"""Recall@k of dense/lexical/hybrid on the retrieval bench's manuals, with the lexical index as shipped and
with the context line (title and headings) weighted W times in the lexical index."""
import json, sys, time
from pathlib import Path
from rag_promptcache.bench import retrieval_data
from rag_promptcache.bench.retrieval import recall_rows
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.lexical import LexicalIndex
from rag_promptcache.rag.chunker import search_text

where = Path("/tmp/cli-wt/manuals")
pages, questions = retrieval_data.load()
t = time.time()
if not where.exists():
    c = Corpus.build([p for ps in pages.values() for p in ps], where, kv="lazy", progress=False)
else:
    c = Corpus.open(where)
print(f"corpus {len(c)} modules in {time.time()-t:.0f}s", flush=True)
texts = retrieval_data.by_source(c)
relevant = [retrieval_data.gold(texts, q) for q in questions]
qs = [q.question for q in questions]
def show(tag):
    for row in recall_rows(c, qs, relevant, "manuals"):
        print(tag, row["mode"], {k: round(v, 3) for k, v in row.items() if k.startswith("recall") or k == "mrr"}, row["questions"], flush=True)
show("shipped")
rows = c.table.db.execute("SELECT faiss_id, context, text FROM modules ORDER BY rowid").fetchall()
import numpy as np
ids = np.array([r[0] for r in rows], np.int64)
for w in (2, 3):
    c.lexical = LexicalIndex(ids, ["\n".join([r[1]] * w) + "\n" + r[2] if r[1] else r[2] for r in rows])
    show(f"context x{w}")
