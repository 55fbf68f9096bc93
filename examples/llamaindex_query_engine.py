"""A LlamaIndex query engine on rag-promptcache: the retriever returns nodes whose ids are module ids,
and the response synthesizer hands those ids to the LLM, which imports their stored KV instead of
reading their text. Runs on the embedded defaults (SmolLM2-135M, a slice of the Python reference).

    python examples/llamaindex_query_engine.py [--corpus DIR] [--topics N] [--questions N] [--max-tokens N]
"""

from __future__ import annotations

import argparse

from llama_index.llms.rag_promptcache import PromptCacheQueryEngine

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
    engine = PromptCacheQueryEngine(corpus=corpus, similarity_top_k=3, streaming=True, max_tokens=args.max_tokens)
    for question in QUESTIONS[: args.questions]:
        print(f"Q: {question}\nA: ", end="", flush=True)
        response = engine.query(question)
        for piece in response.response_gen:
            print(piece, end="", flush=True)
        sources = dict.fromkeys(n.node.metadata["where"] for n in response.source_nodes)  # "file › section"
        print(f"\n   sources: {', '.join(sources)}\n")
    corpus.close()


if __name__ == "__main__":
    main()
