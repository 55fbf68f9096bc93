"""`make test-coarse` coarsens the clocks of every process its tests run in (tests/coarse_clock/), the
pytest-xdist workers that run them included: this test runs in one of them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest


def test_under_the_coarse_tier_this_process_has_the_coarse_clocks():
    asked = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if Path(p).name == "coarse_clock"]
    if not asked:
        pytest.skip("not under make test-coarse (PYTHONPATH names no tests/coarse_clock)")
    loaded = sys.modules.get("sitecustomize")
    assert loaded is not None and Path(loaded.__file__).parent.name == "coarse_clock", loaded
    step = loaded.STEP_NS
    assert step > 0 and all(time.perf_counter_ns() % step == 0 and time.monotonic_ns() % step == 0 for _ in range(100))
