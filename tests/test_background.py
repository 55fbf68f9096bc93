"""A missed module is computed in the request and stored off its path (engine/planning/background.py).

The bookkeeping (queue, coalescing, drops, admission, activity) is tested without tensors; the engine
tests run a real tiny model: the deferred answer equals full prefill's token for token (every missed
token is computed in that prefill, in place), the background encoder stores exactly what `misses="encode"`
stores, it never runs while a request is in flight, and a store that refuses writes costs no answer."""

from __future__ import annotations

import threading

import pytest

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.compute.runner import decoder_layers
from rag_promptcache.engine.planning.background import Activity, Admission, EncodeQueue, Job, misses_policy
from rag_promptcache.engine.prompt.compiler import Unit
from rag_promptcache.store import MemoryStore, TieredStore
from rag_promptcache.store.base import is_full
from tests.tiny import build

SCHEMA = """<schema name="s">
  <module name="a">The quick brown fox jumps over the lazy dog near the river bank.</module>
  <module name="b">Paris is the capital of France, and the Seine runs through it.</module>
  <module name="c">Tokyo has great food, and its trains run on time.</module>
</schema>"""
BOTH = '<prompt schema="s"><a/><b/> Where?</prompt>'


def job(key: str) -> Job:
    return Job(key, Unit(name=key, token_ids=(1, 2, 3), segs=(), encode_start=0, context_ids=()), 3)


# -- bookkeeping ------------------------------------------------------------------------------------

def test_the_queue_coalesces_a_key_and_drops_past_its_bound():
    q = EncodeQueue(max_jobs=2)
    assert [j.key for j in q.offer([job("a"), job("b")])] == ["a", "b"]
    assert q.offer([job("a"), job("c")]) == []  # a: queued already; c: no room
    assert (q.num_coalesced, q.num_dropped, len(q)) == (1, 1, 2)
    assert [q.take().key, q.take().key, q.take()] == ["a", "b", None]  # oldest first
    assert [j.key for j in q.offer([job("c")])] == ["c"]


def test_second_admission_queues_a_module_missed_twice_within_its_window():
    q = EncodeQueue(admission=Admission.parse("second:2"))
    assert q.offer([job("a"), job("b")]) == [] and q.num_deferred == 2
    assert [j.key for j in q.offer([job("a")])] == ["a"]  # the second miss within 2 requests
    q.offer([job("c")])
    assert q.offer([job("b")]) == []  # b's first miss left the window of the last 2 requests
    assert str(q.admission) == "second:2" and str(Admission.parse(None)) == "auto"


def test_auto_admission_queues_every_miss_until_the_store_is_full_then_the_second():
    q = EncodeQueue(admission=Admission.parse("auto:2"))
    assert [j.key for j in q.offer([job("a"), job("b")], full=lambda j: False)] == ["a", "b"]  # room: first
    q.take(), q.take()
    assert q.offer([job("c")], full=lambda j: True) == [] and q.num_deferred == 1  # full: c missed once
    assert [j.key for j in q.offer([job("c")], full=lambda j: True)] == ["c"]  # twice within 2 requests
    assert [j.key for j in q.offer([job("d")], full=lambda j: j.key != "d")] == ["d"]  # d's store has room
    assert str(q.admission) == "auto:2" and str(Admission.parse("auto")) == "auto"


def held_bytes(pc: PromptCache, name: str) -> int:
    """What a MemoryStore holds for module `name` of schema s, alone."""
    probe = engine(pc.model, pc.tokenizer)
    probe.encode("s", [name])
    return probe.store.stats().num_bytes


def test_a_store_is_full_when_its_last_tier_holds_its_budget(model, tokenizer):
    pc = engine(model, tokenizer)
    pc.encode("s", ["a"])
    kv = pc.store.get(pc.store_keys("s", ["a"])["a"])
    size = held_bytes(pc, "a")
    small, roomy = MemoryStore(max_bytes=size), MemoryStore(max_bytes=100 * size)
    assert not is_full(small) and not is_full(MemoryStore())
    small.put("k", kv), roomy.put("k", kv)
    assert is_full(small) and not is_full(roomy) and not is_full(TieredStore([small, roomy]))
    assert is_full(TieredStore([roomy, small]))  # the last tier is where an entry lives longest


def test_auto_admission_stops_queueing_single_misses_once_the_store_is_full(model, tokenizer):
    size = held_bytes(engine(model, tokenizer), "a")
    pc = engine(model, tokenizer, store=MemoryStore(max_bytes=int(size / 0.96)), admission="auto")
    pc.generate('<prompt schema="s"><a/> Where?</prompt>', max_new_tokens=1)
    settle(pc)
    assert pc.background.stats().num_encoded == 1  # room: stored on its first miss, and now the store is full
    pc.generate('<prompt schema="s"><c/> Food?</prompt>', max_new_tokens=1)
    settle(pc)
    stats = pc.background.stats()
    assert (stats.num_encoded, stats.num_deferred) == (1, 1)  # full: c missed once is not worth evicting a
    pc.generate('<prompt schema="s"><c/> Trains?</prompt>', max_new_tokens=1)
    settle(pc)
    assert pc.background.stats().num_encoded == 2  # missed twice within 20 requests: stored


@pytest.mark.parametrize("spec", ["second", "second:0", "third:2", "often", "auto:0"])
def test_bad_admission_and_misses_policies_are_refused_by_name(spec):
    with pytest.raises(ValueError, match="first .* second:W"):
        Admission.parse(spec)
    with pytest.raises(ValueError, match="valid: defer, encode"):
        misses_policy(spec)


def test_activity_counts_tickets_once_and_wakes_the_idle_waiter():
    act = Activity()
    ticket = act.begin()
    with act.request():
        assert act.busy
    ticket.end()
    ticket.end()  # idempotent: a stream's end and its collection both end it
    assert not act.busy and act.wait_idle(lambda: False)
    act.enter()
    released = threading.Event()
    waiter = threading.Thread(target=lambda: (act.wait_idle(lambda: False), released.set()))
    waiter.start()
    assert not released.wait(0.2)  # still busy
    act.exit()
    assert released.wait(10)
    waiter.join()


# -- the engine ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model(tokenizer):
    return build("llama", vocab_size=len(tokenizer))


def engine(model, tokenizer, store=None, **kwargs) -> PromptCache:
    pc = PromptCache(model, tokenizer, store=store or MemoryStore(),
                     **{"recovery": "none", "fallback": "never", "misses": "defer", **kwargs})
    pc.add_schema(SCHEMA)
    return pc


def settle(pc: PromptCache) -> None:
    """Wait for the background encoder's queue to empty (it runs when no request is in flight)."""
    assert pc.background.wait_done(timeout=120), pc.background.stats()


def test_a_deferred_miss_answers_as_full_prefill_and_is_stored_as_an_encoded_one(model, tokenizer):
    pc = engine(model, tokenizer)
    full = pc.generate(BOTH, use_cache=False, max_new_tokens=6)
    first = pc.generate(BOTH, max_new_tokens=6)
    assert set(first.missed_modules) == set(first.deferred_modules) == {"a", "b"} and first.served == "deferred"
    assert first.token_ids == full.token_ids  # every missed token was computed in this prefill, in place
    settle(pc)
    assert pc.background.stats().num_encoded == 2  # a and b (the schema has no text of its own)
    second = pc.generate(BOTH, max_new_tokens=6)
    assert set(second.hit_modules) == {"a", "b"} and second.served == "store"
    waited = engine(model, tokenizer, misses="encode")
    reference = waited.generate(BOTH, max_new_tokens=6)
    assert reference.served == "waited" and reference.deferred_modules == ()
    assert second.token_ids == reference.token_ids  # the background stores what an in-request encoding stores
    for name in ("a", "b"):
        key = pc.store_keys("s", [name])[name]
        assert pc.store.get(key).keys.equal(waited.store.get(key).keys)


def test_the_background_encoder_waits_for_the_request_in_flight(model, tokenizer):
    pc = engine(model, tokenizer)
    stream = pc.stream(BOTH, max_new_tokens=8, ignore_eos=True)
    next(stream)
    assert pc.activity.busy
    assert not pc.background.wait_done(timeout=0.5)  # queued, and nothing encoded while the answer runs
    assert pc.background.stats().num_encoded == 0 and pc.background.stats().num_queued == 2
    stream.consume()
    settle(pc)
    assert pc.background.stats().num_encoded == 2


def test_a_job_due_as_a_request_arrives_goes_back_unencoded(model, tokenizer):
    class Arriving(MemoryStore):
        arrived = False

        def contains(self, key):
            if not self.arrived and threading.current_thread().name == "rag-promptcache-encoder":
                self.arrived = True
                pc.activity.enter()  # a request arrives while the encoder asks the store about its job
            return super().contains(key)

    pc = engine(model, tokenizer, store=Arriving())
    pc.generate(BOTH, max_new_tokens=1)
    assert not pc.background.wait_done(timeout=0.5)
    stats = pc.background.stats()
    assert (stats.num_yielded, stats.num_encoded, stats.num_queued) == (1, 0, 2)
    pc.activity.exit()
    settle(pc)
    assert pc.background.stats().num_encoded == 2


def test_a_request_stops_a_background_forward_between_layers(model, tokenizer):
    pc = engine(model, tokenizer)
    arrived = []

    def arrive(*_):
        if not arrived and threading.current_thread().name == "rag-promptcache-encoder":
            arrived.append(True)
            pc.activity.enter()  # a request arrives while a background forward is in its first layer

    handle = decoder_layers(model)[0].register_forward_pre_hook(arrive)
    try:
        pc.generate(BOTH, max_new_tokens=1)
        assert not pc.background.wait_done(timeout=0.5)
        stats = pc.background.stats()
        assert (stats.num_yielded, stats.num_encoded, stats.num_queued) == (1, 0, 2)
    finally:
        handle.remove()
    pc.activity.exit()
    settle(pc)
    assert pc.background.stats().num_encoded == 2
    assert pc.background.stats().num_failed == 0


def test_a_stream_dropped_unread_frees_the_encoder(model, tokenizer):
    pc = engine(model, tokenizer)
    stream = pc.stream(BOTH, max_new_tokens=4)
    assert pc.activity.busy
    del stream
    settle(pc)
    assert not pc.activity.busy


def test_last_n_counts_a_deferred_module_among_the_nearest(model, tokenizer):
    pc = engine(model, tokenizer, recovery="last:1")
    pc.generate('<prompt schema="s"><a/> Where?</prompt>', max_new_tokens=1)
    settle(pc)  # a is stored; b, nearest the question, is not
    res = pc.generate(BOTH, max_new_tokens=1)
    assert res.hit_modules == ("a",) and res.deferred_modules == ("b",)
    assert res.recomputed_modules == ()  # last:1's module is b, computed in the prefill already
    assert res.cached_tokens == sum(len(p.token_ids) for p in pc.plan(BOTH, misses="encode").pieces
                                    if p.unit == "a")


def test_the_batcher_defers_misses_and_the_encoder_waits_for_its_rows(model, tokenizer):
    pc = engine(model, tokenizer)
    with pc.scheduler(max_batch=2) as batcher:
        handles = [batcher.submit(p, max_new_tokens=4) for p in (BOTH, '<prompt schema="s"><c/> Food?</prompt>')]
        results = [h.consume() for h in handles]
    assert {m for r in results for m in r.deferred_modules} == {"a", "b", "c"}
    settle(pc)
    assert pc.background.stats().num_encoded == 3


def test_a_failed_background_encode_loses_no_answer_and_no_entry(model, tokenizer):
    class Refusing(MemoryStore):
        def put(self, key, kv):
            raise OSError("No space left on device")

    pc = engine(model, tokenizer, store=Refusing())
    expected = pc.generate(BOTH, use_cache=False, max_new_tokens=4).token_ids
    for _ in range(2):
        assert pc.generate(BOTH, max_new_tokens=4).token_ids == expected
        settle(pc)
    stats = pc.background.stats()
    assert stats.num_failed >= 2 and stats.num_encoded == 0 and "No space left" in stats.last_error
    assert pc.store.stats().num_entries == 0


def test_close_stops_a_background_forward_at_its_next_layer(model, tokenizer):
    pc = engine(model, tokenizer)
    in_forward = threading.Event()

    def hold(*_):  # the encoder's first forward waits in its first layer until close() has been asked
        if threading.current_thread().name == "rag-promptcache-encoder" and not in_forward.is_set():
            in_forward.set()
            for _ in range(500):
                if pc.background.closed:
                    return
                threading.Event().wait(0.01)

    handle = decoder_layers(model)[0].register_forward_pre_hook(hold)
    try:
        pc.generate(BOTH, max_new_tokens=1)
        assert in_forward.wait(60)
        pc.background.close()  # joins the thread: returns once the forward stopped
    finally:
        handle.remove()
    stats = pc.background.stats()
    assert (stats.num_yielded, stats.num_encoded, stats.num_failed) == (1, 0, 0)
    assert pc.store.stats().num_entries == 0


def test_an_idle_steps_forward_gives_way_to_a_request_and_runs_again(model, tokenizer):
    pc = engine(model, tokenizer)
    arrived, done = [], threading.Event()

    def arrive(*_):
        if not arrived and threading.current_thread().name == "rag-promptcache-encoder":
            arrived.append(True)
            pc.activity.enter()  # a request arrives while the idle step's forward is in its first layer

    def warm() -> bool:
        if pc.is_cached("s", "c"):
            done.set()
            return False
        pc.encode("s", ["c"])
        return True

    handle = decoder_layers(model)[0].register_forward_pre_hook(arrive)
    try:
        pc.background.start_idle(warm)
        assert not done.wait(0.5)
        assert pc.background.stats().num_yielded == 1 and not pc.is_cached("s", "c")
    finally:
        handle.remove()
    pc.activity.exit()
    assert done.wait(120)
    assert pc.background.stats().num_failed == 0


EXITING = """
import sys, threading
import torch
sys.path.insert(0, {root!r})
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.compute.runner import decoder_layers
from rag_promptcache.store import MemoryStore
from tests.tiny import build
from tests.test_background import SCHEMA, BOTH
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({tokenizer!r})
model = build("llama", vocab_size=len(tokenizer))
in_forward = threading.Event()
def slow(*_):  # a layer as long as a real model's: torch work in flight, off the interpreter's lock
    if threading.current_thread().name == "rag-promptcache-encoder":
        in_forward.set()
        for _ in range(100):
            torch.randn(600, 600) @ torch.randn(600, 600)
decoder_layers(model)[0].register_forward_pre_hook(slow)
pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none", fallback="never", misses="defer")
pc.add_schema(SCHEMA)
print(pc.generate(BOTH, max_new_tokens=1).served)
assert in_forward.wait(60)
"""  # the script ends while the background encoder is in a forward


def test_a_script_that_ends_during_a_background_forward_exits_cleanly(tokenizer, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exiting.py"
    script.write_text(EXITING.format(root=str(Path(__file__).parent.parent), tokenizer=tokenizer.name_or_path))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]  # it aborted (134, "terminate called ...") before
    assert done.stdout.strip() == "deferred" and "terminate called" not in done.stderr


def test_serves_prefill_admission_variable_is_not_the_encoders(model, tokenizer, monkeypatch):
    monkeypatch.setenv("RAG_PROMPTCACHE_ADMISSION", "one")  # `serve --admission one`: it failed every engine before
    assert str(engine(model, tokenizer).background.queue.admission) == "auto"
    monkeypatch.setenv("RAG_PROMPTCACHE_ENCODER_ADMISSION", "second:5")
    assert str(engine(model, tokenizer).background.queue.admission) == "second:5"
