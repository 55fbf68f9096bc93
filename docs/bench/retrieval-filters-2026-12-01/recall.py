"""recall@k on the real manuals (`make manuals`), unfiltered and filtered to each question's manual and page: the
numbers in docs/retrieval.md ("a filter keeps recall"). Run from the repository root: python docs/bench/retrieval-filters-2026-12-01/recall.py"""
import sys, tempfile, json
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
from rag_promptcache.bench import retrieval_data
from rag_promptcache.bench.retrieval import KS, recall_rows
from rag_promptcache.rag.corpus import Corpus
from tests.tiny_llama import save_tiny_llama

pages, questions = retrieval_data.load()
tmp = Path(tempfile.mkdtemp())
model = save_tiny_llama(tmp / "m")  # SmolLM2's tokenizer: the same chunks as the bench's model; retrieval reads no weights
c = Corpus.build([p for ps in pages.values() for p in ps], tmp / "manuals", model=model, progress=False, redis_url="", kv="lazy")
texts = retrieval_data.by_source(c)
relevant = [retrieval_data.gold(texts, q) for q in questions]
print(f"{len(c)} modules, {sum(map(bool, relevant))} answerable questions")
rows = recall_rows(c, [q.question for q in questions], relevant, "manuals")
for scope, filters in retrieval_data.scopes(pages, questions).items():
    rows += recall_rows(c, [q.question for q in questions], relevant, f"manuals within the {scope}", filters)
for r in rows:
    print(r["set"], r["mode"], *(f"recall@{k} {r[f'recall@{k}']:.2f}" for k in KS), f"MRR {r['mrr']:.2f}")
json.dump([{k: v for k, v in r.items() if k != "missed@4"} for r in rows], open(Path(__file__).with_name("recall.json"), "w"), indent=1)
