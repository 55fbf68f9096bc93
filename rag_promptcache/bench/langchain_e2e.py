"""End to end in LangChain: time to the first streamed token of one LCEL RAG chain,

    {"context": retriever | format_modules, "question": passthrough} | prompt | llm

with `llm` = `langchain_huggingface.HuggingFacePipeline` (the class users drop in today, on the same
model object) against `PromptCacheLLM`, which imports the retrieved modules' stored KV. Both use our
`PromptCacheRetriever` over one small corpus of demo topics, so both see the same documents; the
pipeline reads the modules' text, ours their cache. Skipped (with the reason) when the adapter or
langchain-huggingface is not installed. Not here: answer quality (quality.py).
"""

from __future__ import annotations

import tempfile
import time

from rag_promptcache.bench.common import Bench, median
from rag_promptcache.bench.quality import TEMPLATES
from rag_promptcache.engine import PromptCache
from rag_promptcache.rag.sample import topic_texts
from rag_promptcache.store import MemoryStore
from rag_promptcache.timing import describe, ratio

TOPICS = ("break", "continue", "pass", "return", "yield", "global", "nonlocal", "del", "assert", "raise")
TEMPLATE = "Answer from the context.\n\nContext:\n{context}\n\nQuestion: {question}\nAnswer:"


def run(bench: Bench) -> dict[str, object]:
    try:
        from langchain_core.output_parsers import StrOutputParser
        from langchain_core.prompts import PromptTemplate
        from langchain_core.runnables import RunnablePassthrough
        from langchain_huggingface import HuggingFacePipeline
        from langchain_rag_promptcache import (
            PromptCacheLLM,
            PromptCacheRetriever,
            format_modules,
        )
    except ImportError as e:
        return {"skipped": f"{e.name or e} is not installed (pip install -e integrations/langchain langchain-huggingface)"}
    from transformers import pipeline

    from rag_promptcache.rag import Corpus

    cfg, model, tok = bench.config, bench.model, bench.tokenizer
    num_questions, k, max_new = (2, 2, 4) if cfg.questions < 20 else (5, 4, 8)
    docs = _documents()
    with tempfile.TemporaryDirectory(prefix="rpc-bench-lc-") as tmp:
        engine = PromptCache(model, tok, store=MemoryStore(), name=bench.model_name, **bench.engine_options)
        t0 = time.perf_counter()
        corpus = Corpus.build(docs, f"{tmp}/corpus", engine=engine, progress=False)
        ingest_s = time.perf_counter() - t0
        retriever = PromptCacheRetriever(corpus=corpus, k=k)
        prompt = PromptTemplate.from_template(TEMPLATE)
        ours = PromptCacheLLM(corpus=corpus, max_tokens=max_new)
        hf = HuggingFacePipeline(pipeline=pipeline("text-generation", model=model, tokenizer=tok, max_new_tokens=max_new,
                                                   do_sample=False, return_full_text=False))
        chains = {
            name: {"context": retriever | format_modules, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
            for name, llm in (("huggingface_pipeline", hf), ("promptcache", ours))
        }
        questions = [TEMPLATES[i % len(TEMPLATES)].format(t=t) for i, t in enumerate(TOPICS[:num_questions])]
        times: dict[str, list[float]] = {name: [] for name in chains}
        for name, chain in chains.items():
            _first_token(chain, questions[0])  # warm-up
        for q in questions:
            for name, chain in chains.items():
                times[name].append(_first_token(chain, q))
        corpus.close()
    s = {name: median(ts) for name, ts in times.items()}
    out = {"questions": len(questions), "k": k, "documents": len(docs), "ingest_s": ingest_s,
           **{f"{name}_first_token_s": v for name, v in s.items()},
           "speedup": ratio(s["huggingface_pipeline"], s["promptcache"]),
           "runs": {name: [round(x, 4) for x in ts] for name, ts in times.items()}}
    bench.log(f"langchain: first streamed token HuggingFacePipeline {s['huggingface_pipeline']:.3f} s, "
              f"PromptCacheLLM {s['promptcache']:.3f} s ({describe(out['speedup'], '.1f', 'x')})")
    return out


def _documents() -> list[object]:
    from langchain_core.documents import Document

    return [Document(page_content=text, metadata={"source": f"pydoc_data.topics/{name}"})
            for name, text in topic_texts(TOPICS).items()]


def _first_token(chain: object, question: str) -> float:
    """Seconds from invoking the chain (retrieval included) to its first non-empty streamed text."""
    t0 = time.perf_counter()
    stream = chain.stream(question)
    seconds = float("nan")
    for piece in stream:
        if piece and seconds != seconds:
            seconds = time.perf_counter() - t0
    return seconds
