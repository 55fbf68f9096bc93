"""Whose calibration it is (engine/planning/costmodel.py): the test suite stores its calibrations in a
folder of its own (tests/conftest.py), a user's live in the cache home's `costs/`, and a stored
calibration that the measured pace of real prefills says is `DRIFT` times off, either way, is measured
again and stored, once per engine, where the CPU is not busy.

Decisions are asserted from injected measurements or on a virtual clock (tests/test_pace.py's), never
from the wall clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rag_promptcache.engine.planning import costmodel
from rag_promptcache.engine.planning.costmodel import (
    COSTS_ENV,
    DRIFT,
    DRIFT_SAMPLES,
    MIN_SPAN_S,
    Costs,
    Fallback,
    FixedPace,
    costs_dir,
    recalibrated_costs,
    stored_costs,
)
from rag_promptcache.model.device import torch_threads
from rag_promptcache.model.loading import cache_home
from rag_promptcache.model.positions import kv_geometry, relocator_for
from rag_promptcache.store import MemoryStore
from tests.test_pace import Clock, Load
from tests.test_recovery import PROMPT, SCHEMA
from tests.tiny import build

ROOT = Path(__file__).resolve().parents[1]
SLOW = Costs(fixed_s=0.0, token_s=0.02, pair_s=0.0, cached_token_s=0.0)  # calibrated under load: 20 ms a token
QUICK = Costs(fixed_s=0.0, token_s=1e-3, pair_s=0.0, cached_token_s=0.0)


def test_the_suite_keeps_its_calibrations_out_of_the_users_folder(monkeypatch) -> None:
    ours = costs_dir()
    assert ours == Path(os.environ[COSTS_ENV]) and ours != cache_home() / "costs"
    # a command the suite starts inherits the folder (the CLI tests run `rag-promptcache` in a child)
    child = subprocess.run([sys.executable, "-c", "from rag_promptcache.engine.planning.costmodel import costs_dir; "
                            "print(costs_dir())"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert child.stdout.strip() == str(ours)
    monkeypatch.delenv(COSTS_ENV)  # a user's own runs: the cache home's costs/, as before
    monkeypatch.setenv("RAG_PROMPTCACHE_HOME", "/somewhere/home")
    assert costs_dir() == Path("/somewhere/home/costs")


def feed(fb: Fallback, factor: float, samples: int) -> None:
    """`samples` pace samples of prefills that take `factor` times what the calibrated costs say."""
    for _ in range(samples):
        modelled = fb.calibrated.full(1000)
        fb.ran(1000, 0, factor * max(modelled, MIN_SPAN_S))


def test_a_pace_within_drift_keeps_the_calibration() -> None:
    calls = []
    fb = Fallback("auto", lambda: SLOW, remeasure=lambda: calls.append(1) or QUICK)
    feed(fb, 1 / (0.8 * DRIFT), 3 * DRIFT_SAMPLES)
    feed(fb, 0.8 * DRIFT, 3 * DRIFT_SAMPLES)
    assert fb.costs is not None and calls == [] and fb.num_recalibrations == 0 and fb.calibrated == SLOW


@pytest.mark.parametrize("factor", [1 / (1.5 * DRIFT), 1.5 * DRIFT])
def test_a_pace_past_drift_measures_again_once_per_engine(factor: float) -> None:
    calls = []
    fb = Fallback("auto", lambda: SLOW, remeasure=lambda: calls.append(1) or QUICK)
    feed(fb, factor, DRIFT_SAMPLES - 1)
    assert fb.costs is not None and calls == []  # a few samples are a burst of load, not a drift
    feed(fb, factor, 1)
    assert fb.calibrated == QUICK and calls == [1] and fb.num_recalibrations == 1
    assert fb.pace.num_samples == 0 and fb.pace.factor == 1.0  # the fresh costs are the machine now
    feed(fb, factor, 3 * DRIFT_SAMPLES)  # still off: the model's shape, not the calibration; no storm
    assert fb.costs is not None and calls == [1]


def test_a_drift_is_measured_by_whoever_was_told_not_inside_a_request() -> None:
    calls, woken = [], []
    fb = Fallback("auto", lambda: SLOW, remeasure=lambda: calls.append(1) or QUICK)
    fb.on_drift = lambda: woken.append(1)  # the engine's: its background encoder, in idle time
    feed(fb, 1 / (1.5 * DRIFT), DRIFT_SAMPLES + 3)
    assert woken == [1] and calls == []  # told once; the requests' decisions ran on the paced costs
    assert fb.calibrated == SLOW and fb.costs is not None
    assert fb.recalibrate() and calls == [1] and fb.calibrated == QUICK and fb.num_recalibrations == 1
    assert not fb.recalibrate() and calls == [1]  # nothing left to measure


def test_a_drift_is_measured_with_the_requests_torch_threads() -> None:
    """The stored costs are keyed by the torch thread count, which is per thread: the encoder's thread
    measures with the count of the requests that saw the drift, and keeps its own after."""
    seen = []
    fb = Fallback("auto", lambda: SLOW, remeasure=lambda: seen.append(torch.get_num_threads()) or QUICK)
    fb.on_drift = lambda: None
    with torch_threads(1):
        feed(fb, 1 / (1.5 * DRIFT), DRIFT_SAMPLES + 3)  # the requests, on one torch thread

    def idle() -> None:  # the background encoder's thread, on two
        torch.set_num_threads(2)
        fb.recalibrate()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=idle)
    thread.start()
    thread.join()
    assert seen == [1, 2] and fb.num_recalibrations == 1


def test_no_new_calibration_where_now_is_no_time_to_measure() -> None:
    answers = [None, QUICK]  # the CPU is busy the first time the drift is seen
    fb = Fallback("auto", lambda: SLOW, remeasure=lambda: answers.pop(0))
    feed(fb, 1 / (2 * DRIFT), DRIFT_SAMPLES)
    assert fb.calibrated == SLOW and fb.num_recalibrations == 0 and answers == [QUICK]
    feed(fb, 1 / (2 * DRIFT), 1)  # still drifted, and idle now
    assert fb.calibrated == QUICK and fb.num_recalibrations == 1
    fixed = Fallback("auto", lambda: SLOW, pace=FixedPace(), remeasure=lambda: pytest.fail("measured"))
    feed(fixed, 10.0, 3 * DRIFT_SAMPLES)  # pacing off: the given costs stand
    assert fixed.calibrated == SLOW


def test_a_recalibration_replaces_the_stored_one_and_waits_out_a_busy_cpu(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv(COSTS_ENV, str(tmp_path))
    model = build("llama", vocab_size=len(tokenizer))
    args = (model, relocator_for(model), kv_geometry(model), "fp-drift")
    monkeypatch.setattr(costmodel, "cpu_busy", lambda: False)
    monkeypatch.setattr(costmodel, "calibrate", lambda *a, **k: SLOW)
    assert stored_costs(*args) == SLOW
    (saved,) = tmp_path.glob("*.json")
    monkeypatch.setattr(costmodel, "calibrate", lambda *a, **k: QUICK)
    monkeypatch.setattr(costmodel, "cpu_busy", lambda: True)
    assert recalibrated_costs(*args) is None  # that moment's costs would be no better
    assert json.loads(saved.read_text())["costs"]["token_s"] == SLOW.token_s and stored_costs(*args) == SLOW
    monkeypatch.setattr(costmodel, "cpu_busy", lambda: False)
    assert recalibrated_costs(*args) == QUICK and stored_costs(*args) == QUICK  # the next engine reads the new one


def test_an_engine_whose_stored_calibration_was_made_under_load_measures_again(tokenizer, tmp_path, monkeypatch):
    """The suite's own story, told with a user's engine: a calibration stored while the CPU ran 20 times
    slower (and `cpu_busy` did not see it). The load is gone: prefills run at 1 ms a token on a virtual
    clock. Within a few requests the pace drifts past `DRIFT`, and the engine's background encoder measures again
    (once no request runs) and stores it."""
    monkeypatch.setenv(COSTS_ENV, str(tmp_path))
    monkeypatch.delenv("RAG_PROMPTCACHE_FALLBACK", raising=False)
    monkeypatch.setattr(costmodel, "cpu_busy", lambda: False)
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)
    Load(monkeypatch, clock).per_token_s = 1e-3
    measured = []
    monkeypatch.setattr(costmodel, "calibrate", lambda *a, **k: measured.append(1) or (SLOW if len(measured) == 1
                                                                                         else QUICK))
    from rag_promptcache.engine import PromptCache

    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     prefix_cache_bytes=0)
    pc.add_schema(SCHEMA)
    for i in range(4 * DRIFT_SAMPLES):
        pc.generate(PROMPT, use_cache=i % 2 == 0, max_new_tokens=1)
        assert pc.background.wait_done(timeout=120)  # a drift is measured while no request runs, not inside one
        if pc.fallback.num_recalibrations:
            break
    assert pc.fallback.num_recalibrations == 1 and measured == [1, 1] and pc.fallback.calibrated == QUICK
    (saved,) = tmp_path.glob("*.json")
    assert json.loads(saved.read_text())["costs"]["token_s"] == QUICK.token_s
