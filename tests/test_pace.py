"""A planner that follows the load (issue 42 §3): the calibrated prefill costs scaled by the pace of the
prefills actually run (engine/planning/costmodel.py `PaceMeter`), so that load-or-recompute and the
full-prefill fallback follow the machine as it is now, not as it was when it calibrated.

Nothing here rests on the wall clock (which steps by tens of milliseconds on these machines, and on a
shared one adds tenths of a second to any forward): decisions are asserted from injected measurements, and
the test with a throttled link and a loaded CPU runs the engine's real measuring code on a virtual clock
that advances only by what the test says each part costs: a get over the link (measured by the real link
meter, store/link.py), and each token that a prefill or an encoding forward computes.
"""

from __future__ import annotations

import math
import time

import pytest

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning import encoder, prefill
from rag_promptcache.engine.planning.costmodel import MIN_SPAN_S, PACE_ALPHA, PACE_LIMIT, Costs, Fallback, PaceMeter
from rag_promptcache.store import MemoryStore, ModuleKV, TieredStore
from rag_promptcache.store.link import Link, LinkMeter
from tests.test_recovery import PROMPT, SCHEMA
from tests.tiny import build


def test_the_meter_folds_spans_and_follows_in_both_directions() -> None:
    m = PaceMeter()
    assert m.factor == 1.0
    m.ran(MIN_SPAN_S / 4, MIN_SPAN_S / 8)  # too short a span to say anything yet
    assert m.factor == 1.0 and m.num_samples == 0
    m.ran(MIN_SPAN_S, MIN_SPAN_S / 2)  # the span reached: (1/8 + 1/2) / (1/4 + 1) of the model's time
    assert m.num_samples == 1 and m.factor == pytest.approx(0.5)  # the first sample replaces the calibration
    m.ran(MIN_SPAN_S, 4 * MIN_SPAN_S)  # four times the model: a moving average of log-ratios
    assert m.factor == pytest.approx(math.exp((1 - PACE_ALPHA) * math.log(0.5) + PACE_ALPHA * math.log(4)))
    for _ in range(30):
        m.ran(MIN_SPAN_S, 2 * MIN_SPAN_S)
    assert m.factor == pytest.approx(2.0)


def test_a_clock_that_did_not_step_keeps_collecting_and_samples_are_bounded() -> None:
    m = PaceMeter()
    for _ in range(10):
        m.ran(MIN_SPAN_S, 0.0)  # a coarse clock read the same before and after
    assert m.num_samples == 0 and m.factor == 1.0
    m.ran(MIN_SPAN_S, 1e-9)  # the first time it moved: one sample over the whole span, held at the limit
    assert m.num_samples == 1 and m.factor == pytest.approx(1 / PACE_LIMIT)
    m.ran(1e-9, 1000.0)
    assert m.factor == pytest.approx(math.exp((1 - PACE_ALPHA) * -math.log(PACE_LIMIT) + PACE_ALPHA * math.log(PACE_LIMIT)))


def test_a_pace_scales_every_cost_and_keeps_the_cached_or_full_choice() -> None:
    # compute 1 ms a token; assembly 0.2 ms a cached token: 900 of 1000 tokens cached
    fb = Fallback("auto", lambda: Costs(fixed_s=0.0, token_s=1e-3, pair_s=0.0, cached_token_s=2e-4))
    assert not fb.use_full(1000, 900)  # 0.28 s cached against 1 s full
    fb.ran(1000, 0, 0.1)  # a full prefill ran ten times faster than calibrated
    assert fb.costs.token_s == pytest.approx(1e-4) and fb.costs.cached_token_s == pytest.approx(2e-5)
    assert fb.calibrated.token_s == 1e-3
    assert not fb.use_full(1000, 900)  # both paths run on this CPU: the choice stays
    never = Fallback("never", lambda: Costs(0.0, 1e-3, 0.0, 2e-4))
    never.ran(1000, 0, 0.1)  # nothing calibrated, nothing paced
    assert never.costs is None and never.pace.num_samples == 0


class FixedLink:
    """A tier holding every module, whose link the test sets: `load_s` seconds per get, whatever its size."""

    def __init__(self, load_s: float) -> None:
        self.inner, self.load = MemoryStore(), load_s

    def link(self) -> Link:
        return Link(latency_s=self.load, bytes_per_s=1.0, bytes_per_token=0.0, decode_s_per_token=0.0, num_samples=1)

    def get(self, key: str) -> ModuleKV | None:
        return self.inner.get(key)

    def put(self, key: str, kv: ModuleKV) -> None:
        self.inner.put(key, kv)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def stats(self):
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def engine(tokenizer, store, fallback, model=None) -> PromptCache:
    pc = PromptCache(model or build("llama", vocab_size=len(tokenizer)), tokenizer, store=store, recovery="none",
                     prefix_cache_bytes=0, fallback=fallback)
    pc.add_schema(SCHEMA)
    return pc


def test_load_or_recompute_follows_injected_prefill_measurements(tokenizer) -> None:
    """Calibrated under load (20 ms a token), a module of about fourteen tokens takes longer to recompute
    than the link's 0.1 s: load it. Prefills then run ten times faster than that: recompute. Then the load
    comes back: load again."""
    tier = FixedLink(0.1)
    store = TieredStore([tier])
    engine(tokenizer, store, "never").generate(PROMPT, max_new_tokens=1)  # every module stored
    pc = engine(tokenizer, store, Fallback("auto", lambda: Costs(fixed_s=0.0, token_s=0.02, pair_s=0.0,
                                                                 cached_token_s=0.0)))
    first = pc.plan(PROMPT)
    assert first.hits and not first.misses  # loaded
    pc.fallback.ran(100, 0, 0.2)  # 100 tokens the costs put at 2 s took 0.2 s
    quick = pc.plan(PROMPT)
    assert quick.misses and not quick.hits  # recomputed: 14 tokens at 2 ms beat a 0.1 s load
    assert quick.path == "cached" and quick.num_encoded_tokens > 0
    for _ in range(4):
        pc.fallback.ran(100, 0, 2.0)  # loaded again: as calibrated
    assert pc.fallback.pace.factor > 0.8  # 0.1 ** (PACE_ALPHA ** 4)
    again = pc.plan(PROMPT)
    assert again.hits and not again.misses


class Clock:
    """Virtual seconds, standing in for `time.perf_counter`: they pass only where the test says that work
    takes time, so what a shared machine adds to a tiny model's forward cannot turn a verdict."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


class Throttled(FixedLink):
    """A tier behind a slow link: every get that finds its entry takes `get_s` (a round trip of a tenth
    of that first, where the meter asks for one), and a real `LinkMeter` measures it."""

    def __init__(self, get_s: float, clock: Clock) -> None:
        super().__init__(get_s)
        self.meter, self.clock = LinkMeter(), clock

    def link(self) -> Link:
        return self.meter.link()

    def get(self, key: str) -> ModuleKV | None:
        if self.meter.wants_round_trip():
            t0 = time.perf_counter()
            self.clock.spend(self.load / 10)
            self.meter.round_trip(time.perf_counter() - t0)
        t0 = time.perf_counter()
        kv = self.inner.get(key)
        if kv is not None:
            self.clock.spend(self.load)
            self.meter.fetch(kv.keys.nbytes + kv.values.nbytes, kv.num_tokens, time.perf_counter() - t0)
            self.meter.decoded(kv.num_tokens, 0.0)
        return kv


class Load:
    """The CPU's load: every prefill and encoding forward takes `per_token_s` per token it computes."""

    def __init__(self, monkeypatch, clock: Clock) -> None:
        self.per_token_s = 0.0
        real_last, real_base = prefill.forward_last, encoder.forward_base

        def last(model, ids, *args, **kwargs):
            clock.spend(self.per_token_s * ids.numel())
            return real_last(model, ids, *args, **kwargs)

        def base(model, ids, *args, **kwargs):
            clock.spend(self.per_token_s * ids.numel())
            return real_base(model, ids, *args, **kwargs)

        monkeypatch.setattr(prefill, "forward_last", last)
        monkeypatch.setattr(encoder, "forward_base", base)


@pytest.mark.slow  # a few seconds on a quiet machine: the engine runs 21 requests on a tiny model
def test_with_a_throttled_link_and_a_loaded_cpu_the_plan_is_never_slower_than_the_better_path(tokenizer,
                                                                                                monkeypatch):
    """Each module crosses a link in 0.4 s (four gets: the schema's root and three modules). The costs were
    calibrated under a load of 50 ms a token. Every request is also run twice more, forced to load (policy
    "never" has no costs: it loads) and forced to recompute (an empty store), under the same load.

    The load drops to 1 ms a token: recomputing beats the link by far, but the calibration says loading, and
    the first request loads. Its prefill is a pace sample; from the next request on the plan is as fast as
    the better path.

    The load comes back: recomputing takes the modules' tokens and the shared prefix's at 50 ms each,
    longer than the link. The recomputing requests' encodings and prefills are pace samples; within two
    requests the plan loads, as fast as the better path again."""
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    per_get_s, loaded = 0.4, 0.05
    load = Load(monkeypatch, clock)
    model = build("llama", vocab_size=len(tokenizer))
    store = TieredStore([Throttled(per_get_s, clock)])
    engine(tokenizer, store, "never", model).generate(PROMPT, max_new_tokens=1)  # every module stored
    forced_load = engine(tokenizer, store, "never", model)
    forced_load.generate(PROMPT, max_new_tokens=1)  # loaded: the link is measured
    assert store.tiers[0].link().load_s(14) == pytest.approx(per_get_s, rel=0.2)
    # pacing alone: a drift's fresh calibration finds the CPU busy (None), so the stale costs stay, paced
    stale = Costs(fixed_s=0.0, token_s=loaded, pair_s=0.0, cached_token_s=0.0)
    pc = engine(tokenizer, store, Fallback("auto", lambda: stale, remeasure=lambda: None), model)

    forced_recompute = engine(tokenizer, MemoryStore(), "never", model)

    def request() -> tuple[str, float, float]:
        """The plan's choice, its TTFT, and the better forced path's."""
        res = pc.generate(PROMPT, max_new_tokens=1)
        assert pc.background.wait_done(timeout=120)  # a drifted calibration is measured again while idle
        choice = "load" if not res.missed_modules else "recompute" if not res.hit_modules else "mixed"
        by_load = forced_load.generate(PROMPT, max_new_tokens=1).ttft_s
        for key in forced_recompute.store.keys():  # emptied: every module encoded again
            forced_recompute.store.delete(key)
        by_recompute = forced_recompute.generate(PROMPT, max_new_tokens=1).ttft_s
        return choice, res.ttft_s, min(by_load, by_recompute)

    load.per_token_s = 0.001
    runs = [request() for _ in range(3)]
    assert [c for c, _, _ in runs] == ["load", "recompute", "recompute"], runs
    assert runs[0][1] > 5 * runs[0][2]  # the calibration's choice, under the load it was made in
    assert all(t <= better * 1.01 for _, t, better in runs[1:]), runs

    load.per_token_s = loaded
    runs = [request() for _ in range(4)]
    assert [c for c, _, _ in runs][2:] == ["load", "load"], runs
    assert all(t <= better * 1.01 for _, t, better in runs[2:]), runs
    assert runs[0][1] > 1.5 * runs[0][2]  # the first request under the new load: recomputed, slower than loading


def test_a_forward_that_carried_decode_rows_is_modelled_with_them() -> None:
    costs = Costs(fixed_s=0.01, token_s=1e-3, pair_s=1e-6, cached_token_s=0.0)
    # two rows of 100 and 300 tokens of KV: a token each, attending to their KV, one fixed cost for all
    assert costs.carrying(8, 50, [100, 300]) == pytest.approx(
        costs.forward(8, 50) + 2 * 1e-3 + 1e-6 * (100.5 + 300.5))
    assert costs.carrying(8, 50, []) == costs.forward(8, 50)
    fb = Fallback("auto", lambda: costs)
    assert fb.calibrated is costs
    modelled = costs.carrying(200, 0, [400] * 4)
    fb.ran(200, 0, 2 * modelled, [400] * 4)  # the forward took twice what the costs say, rows and all
    assert fb.pace.num_samples == 1 and fb.pace.factor == pytest.approx(2.0)
