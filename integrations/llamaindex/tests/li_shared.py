"""The real SmolLM2 engine and a tiny corpus, made once per test session."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile

import torch

torch.set_num_threads(2)

FACTS = [
    "The Eiffel Tower is in Paris. It was completed in 1889.",
    "Mount Fuji is the highest mountain in Japan, at 3776 metres.",
    "The Amazon is the largest rainforest on Earth, mostly in Brazil.",
    "Python was created by Guido van Rossum and first released in 1991.",
]


@functools.cache
def engine():
    from rag_promptcache.engine import PromptCache

    return PromptCache.from_pretrained("smollm2-135m-instruct")


@functools.cache
def corpus():
    from llama_index.core.schema import TextNode
    from rag_promptcache.rag import Corpus

    root = tempfile.mkdtemp(prefix="li-corpus-")
    atexit.register(shutil.rmtree, root, True)
    nodes = [TextNode(text=t, metadata={"source": f"fact{i}.txt"}) for i, t in enumerate(FACTS)]
    return Corpus.build(nodes, f"{root}/corpus", engine=engine(), progress=False)


class Asked(list):
    """The keyword options of each call of an engine's `generate` and `stream`, oldest first (the engine's
    own calls inside one come after it); `cap`: each runs with at most this many new tokens."""

    cap: int | None = None


def record_calls(engine, monkeypatch) -> Asked:
    calls = Asked()
    for name in ("generate", "stream"):
        real = getattr(engine, name)

        @functools.wraps(real)
        def record(prompt, _real=real, **options):
            calls.append(options)
            ran = options if calls.cap is None else {**options, "max_new_tokens": min(options.get("max_new_tokens", calls.cap), calls.cap)}
            return _real(prompt, **ran)

        monkeypatch.setattr(engine, name, record)
    return calls
