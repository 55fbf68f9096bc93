"""Loading that adapts to the link: the per-process link meter (store/link.py), concurrent gets of one
key sharing one load (TieredStore), and the planner recomputing a module when its measured load
would finish later (engine/planning/plan.py `recompute_sooner`), against a real redis-server."""

from __future__ import annotations

import threading
import uuid

import pytest

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning.costmodel import Costs, Fallback
from rag_promptcache.store import MemoryStore, ModuleKV, RedisStore, TieredStore
from rag_promptcache.store.link import ALPHA, LinkMeter
from tests.store_helpers import key_of, make_kv, needs_redis
from tests.test_recovery import PROMPT, SCHEMA
from tests.tiny import build


def test_meter_separates_latency_bandwidth_and_decode() -> None:
    m = LinkMeter(resolution_s=1e-6)
    assert m.link().load_s(100) is None  # nothing measured: no estimate
    m.round_trip(0.010)
    m.fetch(1_000_000, 100, 0.010 + 0.100)  # 10 MB/s once the round trip is taken out
    m.decoded(100, 0.005)
    link = m.link()
    assert link.latency_s == pytest.approx(0.010) and link.bytes_per_s == pytest.approx(1e7)
    assert link.bytes_per_token == pytest.approx(1e4) and link.decode_s_per_token == pytest.approx(5e-5)
    assert link.load_s(200) == pytest.approx(0.010 + 200 * (1e4 / 1e7 + 5e-5))
    m.round_trip(0.020)  # moving averages: the newest sample weighs ALPHA
    assert m.link().latency_s == pytest.approx((1 - ALPHA) * 0.010 + ALPHA * 0.020)
    assert m.link().num_samples == 3


def test_meter_sums_calls_until_they_span_enough_of_a_coarse_clock() -> None:
    # a clock of 50 ms steps times a 20 ms call as 0 or 50 ms: no estimate from a few of them, the
    # mean of enough of them (at least MIN_STEPS steps in all)
    m = LinkMeter(resolution_s=0.05)
    for _ in range(10):
        m.round_trip(0.0)
        m.round_trip(0.05)
    assert m.link().latency_s is None and m.link().num_samples == 20 and m.wants_round_trip() is False
    for _ in range(15):
        m.round_trip(0.0)
        m.round_trip(0.05)
    assert m.link().latency_s == pytest.approx(0.025) and m.link().num_samples == 50
    m.fetch(2_000_000, 100, 0.0)  # the bytes per token need no clock
    assert m.link().bytes_per_token == 20_000 and m.link().bytes_per_s is None and m.link().load_s(10) is None
    m.fetch(2_000_000, 100, 1.05)
    assert m.link().bytes_per_s == pytest.approx(4e6 / (1.05 - 2 * 0.025))


def test_decodes_below_the_clock_count_as_their_mean_so_far() -> None:
    # an fp16 entry decodes in no measurable time: the link is still known (the decode's mean so far,
    # here zero), not None for ever
    m = LinkMeter(resolution_s=1e-6)
    m.round_trip(0.010)
    m.fetch(1_000_000, 100, 0.110)
    m.decoded(100, 0.0)
    assert m.link().decode_s_per_token == 0.0
    assert m.link().load_s(100) == pytest.approx(0.010 + 100 * 1e4 / 1e7)
    m.decoded(100, 0.004)  # the span reached: a measured decode
    assert m.link().decode_s_per_token == pytest.approx(2e-5)


class Gate:
    """A tier whose gets wait for the test to open a gate, counting the gets that reach it."""

    def __init__(self, kv: ModuleKV) -> None:
        self.kv, self.num_gets, self.open, self.entered = kv, 0, threading.Event(), threading.Event()

    def get(self, key: str) -> ModuleKV | None:
        self.num_gets += 1
        self.entered.set()
        self.open.wait(10)
        return self.kv

    def put(self, key: str, kv: ModuleKV) -> None: ...

    def contains(self, key: str) -> bool:
        return True

    def delete(self, key: str) -> bool:
        return False

    def stats(self):
        return MemoryStore().stats()

    def close(self) -> None: ...


def test_concurrent_gets_of_one_key_share_one_load() -> None:
    kv = make_kv(1)
    gate = Gate(kv)
    store = TieredStore([MemoryStore(), gate])
    got: list[ModuleKV | None] = []
    first = threading.Thread(target=lambda: got.append(store.get("k")))
    first.start()
    assert gate.entered.wait(10)
    others = [threading.Thread(target=lambda: got.append(store.get("k"))) for _ in range(5)]
    for t in others:
        t.start()
    while store.num_shared_loads < 5:  # every other caller is waiting on the first one's load
        threading.Event().wait(0.01)
    gate.open.set()
    for t in (first, *others):
        t.join(10)
    assert gate.num_gets == 1 and len(got) == 6 and all(g is kv for g in got)
    assert store.stats().num_hits == 6
    assert store.get("k") is not None and gate.num_gets == 1  # promoted: later gets stay in memory


def costs(token_s: float) -> Fallback:
    # no fixed cost and no assembly cost: the cached plan always wins the path decision
    return Fallback("auto", lambda: Costs(fixed_s=0.0, token_s=token_s, pair_s=0.0, cached_token_s=0.0))


@needs_redis
@pytest.mark.parametrize("token_s, loads", [(1.0, True), (1e-12, False)])
def test_the_planner_loads_or_recomputes_whichever_is_sooner(redis_server, tokenizer, token_s: float,
                                                             loads: bool) -> None:
    model = build("llama", vocab_size=len(tokenizer))
    redis = RedisStore(redis_server.url, prefix=uuid.uuid4().hex)
    redis.meter = LinkMeter(resolution_s=0.0)  # every sample counts, even one a coarse clock measured as zero

    def engine(fallback) -> PromptCache:
        pc = PromptCache(model, tokenizer, store=TieredStore([MemoryStore(), redis]), recovery="none",
                         prefix_cache_bytes=0, fallback=fallback)
        pc.add_schema(SCHEMA)
        return pc

    want = engine("never").generate(PROMPT, max_new_tokens=4, ignore_eos=True)  # stores every module
    engine("never").generate(PROMPT, max_new_tokens=1)  # a fresh memory tier: loads, and measures the link
    redis.meter.round_trip(1e-3)  # at least a few tenths of a millisecond per load, however coarse the clock
    assert redis.link().load_s(10) is not None
    gets = redis.stats().num_hits
    # a second's compute per token is slower than any loopback load; a picosecond is faster
    got = engine(costs(token_s)).generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    assert got.token_ids == want.token_ids
    if loads:
        assert got.hit_modules and not got.missed_modules and redis.stats().num_hits > gets
    else:
        assert got.missed_modules and not got.hit_modules and redis.stats().num_hits == gets
    redis.close()


@needs_redis
def test_a_redis_get_is_measured(redis_server) -> None:
    redis = RedisStore(redis_server.url, prefix=uuid.uuid4().hex, chunk_bytes=1000)
    kv = make_kv(2, num_tokens=64)
    redis.put(key_of(kv), kv)
    assert redis.get(key_of(kv)) is not None
    link = redis.link()
    assert link.num_samples >= 2  # the manifest's round trip and the chunks' transfer
    assert link.bytes_per_token >= kv.num_bytes / 64  # the entry's bytes, header and all
    # a loopback call may be shorter than the clock's step: then no estimate yet, never a negative one
    assert link.latency_s is None or link.latency_s >= 0
    assert link.bytes_per_s is None or link.bytes_per_s > 0
    redis.close()
