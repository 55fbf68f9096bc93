"""A LlamaIndex query engine on rag-promptcache: the retriever returns nodes whose ids are module ids,
and the response synthesizer hands those ids to the LLM, which imports their stored KV instead of
reading their text. Runs on the embedded defaults (SmolLM2-135M, a slice of the Python reference).

    python examples/llamaindex_query_engine.py [--corpus DIR] [--topics N] [--questions N] [--max-tokens N]
"""

from __future__ import annotations

import argparse

from llama_index.llms.rag_promptcache import PromptCacheQueryEngine

from rag_promptcache.rag import Corpus
from rag_promptcache.rag.sample import QUESTIONS, demo_home, sample_documents


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),  # the whole first paragraph
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--corpus", default=str(demo_home()))
    ap.add_argument("--topics", type=int, default=None, help="ingest only the first N topics")
    ap.add_argument("--questions", type=int, default=len(QUESTIONS))
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()

    corpus = Corpus.build(sample_documents()[: args.topics], args.corpus, progress=True)  # creates, or adds what is new
    engine = PromptCacheQueryEngine(corpus=corpus, similarity_top_k=3, streaming=True, max_tokens=args.max_tokens)
    for question in QUESTIONS[: args.questions]:
        print(f"Q: {question}\nA: ", end="", flush=True)
        response = engine.query(question)
        for piece in response.response_gen:
            print(piece, end="", flush=True)
        sources = dict.fromkeys(corpus.source(n.node.node_id) for n in response.source_nodes)
        print(f"\n   sources: {', '.join(sources)}\n")
    corpus.close()


if __name__ == "__main__":
    main()
