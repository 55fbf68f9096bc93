"""`tune`'s progress bar: its phases, steps against the time budget (not an unreachable --steps), and
the time left of the whole command with the check after training counted (issue 43: `--minutes 3`
ran 414 s behind a bar at 0/1000). Over a fake clock."""

from __future__ import annotations

import re

from rag_promptcache.cli.tune_progress import Meter
from rag_promptcache.tune.corpus import PHASES


def test_steps_are_counted_against_the_budget_and_the_check_after_is_in_the_time_left() -> None:
    now = [0.0]
    meter = Meter(180.0, 1000, clock=lambda: now[0])
    meter.phase(PHASES[0], 2)
    assert "2 model(s); then training (3 min at most) and a check, on top" == meter.check_line()
    now[0] = 120.0  # two models checked in 120 s: the check after (one model) takes about 60 s
    meter.phase(PHASES[1], 0)
    assert meter.reachable(10, 30.0) == 60  # 10 steps in 30 s: the 150 s left reach 50 more, not 1000
    assert meter.left_s(10, 30.0) == 150.0 + 60.0
    assert meter.training_line(10, 30.0) == "step 10 of ~60 in the budget; ~4 min left in all, the check after ~1 min of it"
    now[0] = 300.0
    meter.phase(PHASES[2], 1)
    now[0] = 370.0
    meter.finish()
    assert meter.checked_s == 120.0 + 70.0  # what came on top of the budget


def test_a_step_limit_reached_first_bounds_the_time_left() -> None:
    meter = Meter(3600.0, 20, clock=lambda: 0.0)
    meter.phase(PHASES[1], 0)  # no check: nothing after training
    assert meter.reachable(10, 30.0) == 20 and meter.left_s(10, 30.0) == 30.0
    assert meter.reachable(0, 0.0) == 20 and meter.left_s(0, 0.0) == 3600.0


def test_the_bar_reads_without_doubled_separators() -> None:
    """tqdm adds ": " after the phase and ", " before the postfix itself: the line shows each once (a
    user saw "training: :" and "budget, , step")."""
    import io

    from rag_promptcache.cli.tune_progress import Bar

    out = io.StringIO()
    now = [0.0]
    bar = Bar(Meter(60.0, 100, clock=lambda: now[0]), file=out)
    bar.phase(PHASES[0], 2)
    now[0] = 120.0  # two models checked in 2 min: the check after takes about one
    bar.phase(PHASES[1], 0)
    bar.progress(3, 15.0, {"kl": 0.25})
    bar.close()
    lines = [ln.strip() for ln in out.getvalue().replace("\r", "\n").splitlines() if ln.strip()]
    assert any(re.match(rf"{PHASES[0]}: \d\d:\d\d, 2 model\(s\); then training", ln) for ln in lines), lines
    assert any(ln.startswith("training:  25%|") and ln.endswith(
        "15/60 s of the budget, step 3 of ~12 in the budget; ~2 min left in all, the check after ~1 min of it; kl 0.250")
        for ln in lines), lines
    assert not [ln for ln in lines if ": :" in ln or ", ," in ln or " ," in ln]
