"""One engine, many threads: `generate` and `stream` called at once from several threads, with schemas
registered meanwhile, give every answer exactly as the same call gives it alone (SmolLM2, greedy).

Selective recovery runs a partial forward with a hook on one decoder layer; without the engine's
model lock another thread's forward pass runs into that hook, and the answers or the calls break."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rag_promptcache.engine import PromptCache
from rag_promptcache.store import MemoryStore, TieredStore

pytestmark = pytest.mark.smollm

FACTS = {
    "paris": "Paris is the capital of France. The Seine runs through it.",
    "fuji": "Mount Fuji is the highest mountain in Japan, at 3776 metres.",
    "amazon": "The Amazon is the largest rainforest on Earth, mostly in Brazil.",
    "python": "Python was created by Guido van Rossum and first released in 1991.",
}
SCHEMA = ('<schema name="facts"><system>Answer from the facts.\n\n'
          + "".join(f'<module name="{m}">{t}</module>' for m, t in FACTS.items()) + "</system></schema>")
CALLS = [  # (modules, question, recovery, stream)
    (["paris"], "What river runs through Paris?", "selective:0.3", False),
    (["fuji"], "How high is Mount Fuji?", "selective:0.3", True),
    (["amazon", "python"], "Where is the Amazon?", "first_k:2", False),
    (["python"], "Who created Python?", "selective:0.5", True),
    (["fuji", "paris"], "Which country is Mount Fuji in?", "none", True),
]


def run(pc: PromptCache, call) -> tuple[int, ...]:
    modules, question, recovery, stream = call
    prompt = '<prompt schema="facts">' + "".join(f"<{m}/>" for m in modules) + f"<user>{question}</user></prompt>"
    if stream:
        s = pc.stream(prompt, recovery=recovery, max_new_tokens=5)
        "".join(s)
        return s.result.token_ids
    return pc.generate(prompt, recovery=recovery, max_new_tokens=5).token_ids


def test_generate_and_stream_from_many_threads_equal_their_alone_answers(smollm):
    model, tokenizer = smollm
    pc = PromptCache(model, tokenizer, store=TieredStore([MemoryStore(max_bytes=2**20), MemoryStore()]))
    pc.add_schema(SCHEMA)
    pc.encode("facts")
    alone = [run(pc, c) for c in CALLS]
    stop = threading.Event()

    def register() -> int:  # schema registrations racing the requests
        n = 0
        while not stop.is_set():
            pc.add_schema(f'<schema name="other{n}"><module name="m">Text {n}.</module></schema>')
            n += 1
            stop.wait(0.002)  # racing, not spinning: a tight loop would starve the requests of the GIL
        return n

    with ThreadPoolExecutor(len(CALLS) + 1) as pool:
        registrar = pool.submit(register)
        try:
            futures = [pool.submit(run, pc, c) for c in CALLS * 2]
            together = [f.result() for f in futures]
        finally:
            stop.set()
        assert registrar.result() > 0
    assert together == alone * 2
