"""An LCEL RAG chain on rag-promptcache: the retrieved chunks' KV is imported from the store, so only
the question is computed. Runs on the embedded defaults (SmolLM2-135M, a slice of the Python
reference that ships with CPython); the first run ingests it (about a minute on two CPU cores).

    python examples/langchain_rag.py [--corpus DIR] [--topics N] [--questions N] [--max-tokens N]
"""

from __future__ import annotations

import argparse

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_rag_promptcache import (
    PromptCacheLLM,
    PromptCacheRetriever,
    format_modules,
)

from rag_promptcache.rag.sample import QUESTIONS, demo_home, sample_corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),  # the whole first paragraph
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--corpus", default=str(demo_home()),
                    help="the sample corpus's directory: built there, or reused if this example built it "
                         "(a corpus with other documents is refused, never written to)")
    ap.add_argument("--topics", type=int, default=None, help="ingest only the first N topics")
    ap.add_argument("--questions", type=int, default=len(QUESTIONS), help="how many of the sample questions to ask")
    ap.add_argument("--max-tokens", type=int, default=96, help="longest answer, in tokens")
    args = ap.parse_args()

    try:
        corpus = sample_corpus(args.corpus, args.topics, progress=True)
    except ValueError as e:  # a corpus of the user's own: refused, not written to
        ap.error(str(e))
    prompt = PromptTemplate.from_template("Context:\n{context}\n\nQuestion: {question}")

    # The two-line swap. The HuggingFacePipeline baseline re-reads every chunk's text on every question:
    #   retriever = vectorstore.as_retriever(search_kwargs={"k": 3})
    #   llm = HuggingFacePipeline.from_model_id("HuggingFaceTB/SmolLM2-135M-Instruct", task="text-generation")
    # and with rag-promptcache the chunks' KV is imported instead:
    retriever = PromptCacheRetriever(corpus=corpus, k=3)
    llm = PromptCacheLLM(corpus=corpus, max_tokens=args.max_tokens)

    chain = {"context": retriever | format_modules, "question": RunnablePassthrough()} | prompt | llm | StrOutputParser()
    for question in QUESTIONS[: args.questions]:
        print(f"Q: {question}\nA: ", end="", flush=True)
        for piece in chain.stream(question):
            print(piece, end="", flush=True)
        print("\n")

    # The per-call statistics come back in generation_info:
    question = QUESTIONS[0]
    rendered = prompt.invoke({"context": format_modules(retriever.invoke(question)), "question": question})
    info = llm.generate([rendered.to_string()]).generations[0][0].generation_info
    print(f"cached {info['cached_tokens']} of {info['prompt_tokens']} prompt tokens; "
          f"computed {info['computed_tokens']}; TTFT {info['ttft_s']:.2f}s")
    corpus.close()


if __name__ == "__main__":
    main()
