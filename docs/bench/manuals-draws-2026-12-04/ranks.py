"""Where the answer's module sits in each split's prompts, dense (the fidelity bench's) against hybrid (`Corpus.ask`'s
default) retrieval: per split, draw and k, of the first 42 questions, how many prompts hold a module whose text
states the expected answer ("in"), and how many have it nearest the question ("nearest": the module `last:1`
recomputes) or among the two nearest. No model forward (a lazy corpus: chunked, embedded, indexed). From the
repository root: PYTHONPATH=. python docs/bench/manuals-draws-2026-12-04/ranks.py > ranks.txt
"""
import collections
import tempfile

from rag_promptcache.bench.fidelity import split_data
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.rag.fidelity import answer_contains

for split in ("bench", "heldout", "manuals"):
    for draw in (0, 1):
        data, chunk = split_data(split, seed_offset=draw)
        qs = data.questions[:42]
        with tempfile.TemporaryDirectory() as tmp:
            c = Corpus.build(data.documents, f"{tmp}/c", chunk_tokens=chunk, kv="lazy", progress=False)
            for k in (4, 8, 12):
                for mode in ("dense", "hybrid"):
                    stats = collections.Counter()
                    for q in qs:
                        ids = [m for m, _ in c.search(q.question, k, mode=mode)]
                        order = c.order(ids)
                        hits = [m for m in order if answer_contains(c.table.module(m)[0], q.answer)]
                        stats["in"] += bool(hits)
                        stats["nearest"] += bool(hits) and order[-1] in hits
                        stats["top2"] += bool(hits) and bool(set(order[-2:]) & set(hits))
                    print(split, draw, k, mode, dict(stats), flush=True)
            c.close()
