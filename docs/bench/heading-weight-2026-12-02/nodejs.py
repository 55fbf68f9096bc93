"""Recall@4 on part of the Node.js API reference (nodejs-doc's api/*.md), questions naming an API whose
heading names it: shipped lexical index vs the context line weighted twice and three times."""
import time
from pathlib import Path
import numpy as np
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.lexical import LexicalIndex

API = Path("/usr/share/doc/nodejs/api")
where = Path("/tmp/cli-wt/node")
QS = [("What does events.once return?", "events.once(emitter"),
      ("What does emitter.prependListener do?", "emitter.prependListener("),
      ("What does events.getEventListeners return?", "events.getEventListeners("),
      ("What does emitter.setMaxListeners do?", "emitter.setMaxListeners("),
      ("What does stream.finished do?", "stream.finished(stream"),
      ("What does stream.pipeline do?", "stream.pipeline(source"),
      ("What does readable.unpipe do?", "readable.unpipe("),
      ("What does writable.cork do?", "writable.cork()"),
      ("What does process.cwd return?", "process.cwd()"),
      ("What does process.hrtime.bigint return?", "process.hrtime.bigint()"),
      ("What does process.memoryUsage return?", "process.memoryUsage()"),
      ("What does child_process.execFileSync return?", "child_process.execFileSync("),
      ("What does child_process.fork do?", "child_process.fork("),
      ("What does subprocess.kill do?", "subprocess.kill("),
      ("What does events.on return?", "events.on(emitter"),
      ("What does emitter.eventNames return?", "emitter.eventNames()")]
t = time.time()
c = Corpus.build([API / f for f in ("events.md", "stream.md", "process.md", "child_process.md")], where, kv="lazy",
                 progress=False) if not where.exists() else Corpus.open(where)
print(f"corpus {len(c)} modules in {time.time()-t:.0f}s", flush=True)
rows = c.table.db.execute("SELECT faiss_id, module_id, context, text FROM modules ORDER BY rowid").fetchall()
ctx = {r[1]: r[2] or "" for r in rows}
gold = [{m for m, x in ctx.items() if h in x} for _, h in QS]
print("gold sizes", [len(g) for g in gold], flush=True)
ids = np.array([r[0] for r in rows], np.int64)
for w in (1, 2, 3):
    c.lexical = LexicalIndex(ids, ["\n".join([r[2]] * w) + "\n" + r[3] if r[2] else r[3] for r in rows])
    for mode in ("hybrid", "lexical"):
        hits = [[m for m, _ in c.search(q, 4, mode)] for q, _ in QS]
        found = [bool(set(h) & g) for h, g in zip(hits, gold)]
        top1 = [bool(h[:1] and h[0] in g) for h, g in zip(hits, gold)]
        print(f"context x{w} {mode}: recall@4 {sum(found)}/{len(QS)}, recall@1 {sum(top1)}/{len(QS)}; missed@4:",
              [q for (q, _), f in zip(QS, found) if not f], flush=True)
