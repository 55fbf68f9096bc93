"""tune's check questions on a real manual: how many the base model's full prefill answers, per phrasing."""
import json, random, sys, tempfile
import torch
torch.set_num_threads(1)
from benchmarks import retrieval_data
from rag_promptcache.model.loading import load_model
from rag_promptcache.rag.corpus import Corpus
from rag_promptcache.tune import check
from rag_promptcache.tune.layout import Layouter

pages, _ = retrieval_data.load()
out = {}
model, tok = load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", adapter="none")
with tempfile.TemporaryDirectory() as tmp:
    corpus = Corpus.build([p for ps in pages.values() for p in ps], f"{tmp}/m", model="smollm2-135m-instruct",
                          kv="lazy", progress=False, redis_url="")
    ids = [m for m, _ in corpus.table.modules()]
    random.Random(0).shuffle(ids)
    texts = [corpus.text(m) for m in ids[:24]]
    layouter = Layouter(tok, corpus.manifest.mode)
    for how in check.PHRASINGS:
        check.PHRASING = how
        rows = check.ask_as_corpus(corpus, [(q, (a,), kind) for q, a, kind in check.made_questions(texts, 24, 0)], 4)
        said = check.answers_of(model, tok, rows, layouter, "base")
        right = check.judge(rows, said)
        out[how] = {"questions": len(rows), "full_right": sum(right["base/full"]), "none_right": sum(right["base/none"]),
                    "too_few": check.too_few_to_judge(rows, said),
                    "examples": [{"q": r.question, "a": r.answers, "full": f} for r, f in zip(rows, said["base/full"])][:24]}
        print(how, {k: v for k, v in out[how].items() if k != "examples"}, flush=True)
    corpus.close()
json.dump(out, open(sys.argv[1], "w"), indent=1)
