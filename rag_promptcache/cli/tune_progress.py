"""`tune`'s progress: which phase it is in (checking before, training, checking after), steps against
the time budget, and the time left of the whole command, the check after training included (estimated
from the check before, per model asked). `Meter` is pure bookkeeping over a clock; `Bar` draws it with
tqdm."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import IO


class Meter:
    """The checks come on top of the training budget (`budget_s`, --minutes): the time left it
    reports is training's plus the check after it."""

    def __init__(self, budget_s: float, steps: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.budget_s, self.steps, self.clock = budget_s, steps, clock
        self.name = ""
        self.started = self.phase_started = clock()
        self.models = 0  # models the current phase asks
        self.per_model_s: float | None = None  # the check before, per model: what the check after will take
        self.checked_s = 0.0  # seconds spent checking so far

    def phase(self, name: str, models: int) -> None:
        now = self.clock()
        if self.name.startswith("checking"):
            self.checked_s += now - self.phase_started
            if self.models:
                self.per_model_s = (now - self.phase_started) / self.models
        self.name, self.models, self.phase_started = name, models, now

    def finish(self) -> None:
        self.phase("", 0)

    def reachable(self, step: int, seconds: float) -> int:
        """Steps the budget reaches at the pace so far (at most --steps)."""
        if step < 1 or seconds <= 0:
            return self.steps
        return min(self.steps, step + int(max(0.0, self.budget_s - seconds) * step / seconds))

    def left_s(self, step: int, seconds: float) -> float:
        """Seconds left of the whole command while training: training's, then the check after it."""
        pace = seconds / step if step else 0.0
        training = max(0.0, self.budget_s - seconds)
        if pace:
            training = min(training, (self.steps - step) * pace)
        return training + (self.per_model_s or 0.0)

    def training_line(self, step: int, seconds: float) -> str:
        after = "" if self.per_model_s is None else f", the check after ~{self.per_model_s / 60:.0f} min of it"
        return (f"step {step} of ~{self.reachable(step, seconds)} in the budget; "
                f"~{self.left_s(step, seconds) / 60:.0f} min left in all{after}")

    def check_line(self) -> str:
        if self.name == "checking before":
            return f"{self.models} model(s); then training ({self.budget_s / 60:.0f} min at most) and a check, on top"
        return "the last phase"


# tqdm writes `{desc}` as "training: " and `{postfix}` as ", step 3 ..." (its own separators, only where set):
# nothing goes between them and the rest, or a line reads "training: :" and "budget, , step".
CHECK_FORMAT = "{desc}{elapsed}{postfix}"
TRAIN_FORMAT = "{desc}{percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s of the budget{postfix}"


class Bar:
    """One tqdm line for the whole command: the phase, then in training the budget spent, the steps and the
    KL; in a check the time so far and what comes after."""

    def __init__(self, meter: Meter, *, disable: bool = False, file: IO[str] | None = None) -> None:
        from tqdm import tqdm

        self.meter = meter
        self.bar = tqdm(total=None, desc="tune", unit="s", disable=disable, bar_format=CHECK_FORMAT, file=file)

    def phase(self, name: str, models: int) -> None:
        self.meter.phase(name, models)
        training = name == "training"
        self.bar.reset(total=round(self.meter.budget_s) if training else None)
        self.bar.bar_format = TRAIN_FORMAT if training else CHECK_FORMAT
        self.bar.set_description(name, refresh=False)
        self.bar.set_postfix_str("starting" if training else self.meter.check_line(), refresh=True)

    def progress(self, step: int, seconds: float, terms: Mapping[str, float]) -> None:
        self.bar.n = min(seconds, self.meter.budget_s)
        self.bar.set_postfix_str(f"{self.meter.training_line(step, seconds)}; kl {terms['kl']:.3f}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
