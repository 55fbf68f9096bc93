"""A multi-turn RAG chatbot in the terminal, on LangChain: each question retrieves chunks whose KV is
imported from the store; answers stream; sources are listed. Embedded defaults (SmolLM2-135M, a
slice of the Python reference). Empty line or Ctrl-D quits.

    python examples/chatbot.py [--corpus DIR] [--topics N] [--max-tokens N] [--ask QUESTION ...]
"""

from __future__ import annotations

import argparse
import sys

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_rag_promptcache import (
    ChatPromptCache,
    PromptCacheRetriever,
    format_modules,
)

from rag_promptcache.rag.sample import demo_home, sample_corpus


def questions(asked: list[str]):
    yield from asked
    if asked:
        return
    while (line := input("you> ").strip() if sys.stdin.isatty() else sys.stdin.readline().strip()):
        yield line


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),  # the whole first paragraph
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--corpus", default=str(demo_home()),
                    help="the sample corpus's directory: built there, or reused if this example built it "
                         "(a corpus with other documents is refused, never written to)")
    ap.add_argument("--topics", type=int, default=None, help="ingest only the first N topics")
    ap.add_argument("--max-tokens", type=int, default=128, help="longest answer, in tokens")
    ap.add_argument("--turns", type=int, default=2, help="earlier exchanges kept in the prompt")
    ap.add_argument("--ask", nargs="*", default=[], help="questions to ask instead of reading the terminal")
    args = ap.parse_args()

    try:
        corpus = sample_corpus(args.corpus, args.topics, progress=True)
    except ValueError as e:  # a corpus of the user's own: refused, not written to
        ap.error(str(e))
    retriever = PromptCacheRetriever(corpus=corpus, k=3)
    chat = ChatPromptCache(corpus=corpus, max_tokens=args.max_tokens)
    history: list[HumanMessage | AIMessage] = []
    try:
        for question in questions(args.ask):
            docs = retriever.invoke(question)
            messages = [SystemMessage(format_modules(docs)), *history[-2 * args.turns :], HumanMessage(question)]
            print("bot> ", end="", flush=True)
            reply = None
            for chunk in chat.stream(messages):
                print(chunk.content, end="", flush=True)
                reply = chunk if reply is None else reply + chunk
            usage = reply.usage_metadata
            print(f"\n     sources: {', '.join(dict.fromkeys(d.metadata['where'] for d in docs))}"
                  f"  ({usage['input_token_details']['cache_read']} of {usage['input_tokens']} prompt tokens cached)\n")
            history += [HumanMessage(question), AIMessage(reply.content)]
    except (EOFError, KeyboardInterrupt):
        print()
    corpus.close()


if __name__ == "__main__":
    main()
