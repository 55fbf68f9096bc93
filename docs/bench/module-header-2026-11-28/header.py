"""How a module names its source (chunker.MODULE_HEADER: label, context, none), measured on bench
--scenarios retrieval's 63 questions about SQLite's and Git's manuals (`make manuals`): k = 4, hybrid
retrieval, full prefill and the default cached path (the shipped adapter and its recovery), bf16, one
thread. `python header.py [label,context,none]` writes header.json beside itself."""
import json, sys, tempfile, time
from pathlib import Path
import torch
from benchmarks import retrieval, retrieval_data
from rag_promptcache.engine import PromptCache
from rag_promptcache.rag import chunker
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.store import MemoryStore

torch.set_num_threads(1)
pages, questions = retrieval_data.load()
out = {}
headers = sys.argv[1].split(",") if len(sys.argv) > 1 else list(chunker.MODULE_HEADERS)
engine = PromptCache.from_pretrained("smollm2-135m-instruct", store=MemoryStore(), dtype="bfloat16")
print("recovery", engine.recovery, flush=True)
for header in headers:
    chunker.MODULE_HEADER = header
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        engine.store = MemoryStore()  # each header's modules alone
        corpus = Corpus.build([p for ps in pages.values() for p in ps], f"{tmp}/m", engine=engine, progress=False)
        texts = retrieval_data.by_source(corpus)
        relevant = [retrieval_data.gold(texts, q) for q in questions]
        res = retrieval.answers(corpus, engine, questions, relevant)
        corpus.close()
    res["seconds"] = time.time() - t0
    out[header] = res
    print(header, {k: v for k, v in res.items() if k != "examples"}, flush=True)
    json.dump(out, open(Path(__file__).with_name("header.json"), "w"), indent=1)
