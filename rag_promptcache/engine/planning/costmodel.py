"""Never slower than not caching (issue 26 §4): whether a cached plan or a plain full prefill of the same
tokens reaches the first token sooner, on this machine.

A cached plan pays for assembling its cached tokens (copy, relocate) and then a forward over its new
tokens against them; a full prefill pays one forward over every token. `Costs` models both:

    forward(n new, c context) = fixed + per_token * n + per_pair * n * (c + n / 2)
    cached(C cached, n new)   = per_cached * C + forward(n, C)
    full(N)                   = forward(N, 0)

`calibrate` measures the coefficients with a few tiny timed forwards and assemblies (tenths of a second
on SmolLM2-135M on an idle CPU; each repeated until it spans `timing.MIN_STEPS` steps of the clock, so
seconds where the clock is coarse), on the first request that needs them, and `stored_costs` keeps them
in `costs_dir()` (the cache home's `costs/`, or `$RAG_PROMPTCACHE_COSTS_DIR`: the test suite keeps its own)
keyed by model fingerprint, device, dtype and threads, so a machine measures once (again once the CPU is
idle, where it was busy while the stored calibration ran: `cpu_busy`).
A calibration is one moment of a machine whose load changes (a busy neighbour, or none any more), so
the costs follow the prefills actually run (the request's own, and encoding a module, which is what
recomputing it costs): `PaceMeter` keeps a moving average of measured over modelled seconds, and
`Fallback.costs` scales every coefficient by it, as store/link.py's meter follows a link for transfers.
Both paths of the cached-or-full choice run on this CPU, so a uniform pace leaves that choice as
calibrated (and two plans of one prompt take the same path); loading a module over a link does not slow
with the CPU, so load-or-recompute follows the pace. A pace that stays `DRIFT` times away from the stored
calibration, either way, on a CPU no other work holds, says the calibration is not this machine's (made
under a load `cpu_busy` did not see, or before the machine changed): it is measured again and stored,
once per engine (`Fallback.num_recalibrations`). A sample is a span of prefills at least `MIN_SPAN_S` long (measured or modelled),
so a clock that steps by tens of milliseconds averages out within it.
`Fallback.use_full` is the one place the decision is made: policy `auto` runs full prefill when its
estimate beats the cached plan's by more than `MARGIN` (a noisy calibration must not send cached
plans to the slow path; within the margin the cached plan is at most that much slower), `never`
always runs the cached plan, `always` always runs full prefill; `RAG_PROMPTCACHE_FALLBACK` sets it
where the caller does not. A calibration that cannot tell a token's cost from noise (no positive
per-token cost) keeps the cached plan. Calibration runs only what the model can: its cached context
is relocated where keys can be (RoPE, ALiBi) and stays where it was encoded where they cannot (learned
absolute positions).

What the prefix cache holds of either path counts as assembled, not computed: a chat's long history,
computed on the full path in an earlier turn, is not sent down the cached path only because its modules
are stored (`use_full`'s `num_new`, `num_reused_full`).

Out of scope: what planning already spent before the decision (fetching KV from the store, encoding
missed modules, which are written back for later requests, recovery's scoring pass) and decode speed,
which is the same on both paths; a load that slows the forward more than the copies, or the reverse
(one pace scales both).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rag_promptcache.engine.kv.assemble import assemble, release
from rag_promptcache.engine.kv.stream import assemble_for, load_all
from rag_promptcache.engine.prompt.compiler import Piece
from rag_promptcache.engine.compute.runner import forward_last
from rag_promptcache.model.device import torch_threads
from rag_promptcache.model.loading import cache_home
from rag_promptcache.model.positions import KVGeometry, Relocator
from rag_promptcache.store.base import ModuleKV
from rag_promptcache.timing import MIN_STEPS, process_resolution, repeat

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FALLBACKS = ("auto", "never", "always")
ENV = "RAG_PROMPTCACHE_FALLBACK"
COSTS_ENV = "RAG_PROMPTCACHE_COSTS_DIR"  # where calibrations are stored (unset: the cache home's costs/)
# calibration sizes: small enough to stay well under half a second on a 135M model on two CPU threads
SHORT, LONG, CONTEXT = 32, 256, 512
MARGIN = 0.05
VERSION = 1
# a 1-minute load average over this many times the cores: other work holds the CPU (`cpu_busy`)
BUSY_LOAD = 1.5
# the pace meter: a sample is a span of prefills this long, measured or modelled; the newest sample's
# weight in the moving average (taken over log-ratios, so a halving and a doubling move it alike);
# how far one sample may put the machine from its calibration (a clock that did not advance says 0)
MIN_SPAN_S = 0.25
PACE_ALPHA = 0.5
PACE_LIMIT = 32.0
# a calibration the pace says is this many times too slow or too fast, over at least DRIFT_SAMPLES samples,
# on a CPU that is not busy, is measured again. Measured (docs/scale-out.md, research/pace_drift.py): one
# made while the CPU was contended is about 5x off (its short timed forwards are preempted), and load added
# after it reads 4.6x; 2.5 is halfway on a log scale, and one busy moment does not move 4 samples that far.
DRIFT = 2.5
DRIFT_SAMPLES = 4


def costs_dir() -> Path:
    """Where calibrations are stored: `$RAG_PROMPTCACHE_COSTS_DIR`, else the cache home's `costs/`."""
    return Path(os.environ.get(COSTS_ENV) or cache_home() / "costs")


def fallback_policy(value: str | None) -> str:
    """`value`, or $RAG_PROMPTCACHE_FALLBACK where None, or "auto"; anything else is a ValueError."""
    policy = os.environ.get(ENV, "auto") if value is None else value
    if policy not in FALLBACKS:
        where = f"${ENV}" if value is None else "fallback"
        raise ValueError(f"unknown {where} {policy!r}; valid: {', '.join(FALLBACKS)}")
    return policy


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds per part of a prefill on this machine (`calibrate`)."""

    fixed_s: float  # per forward, whatever its size
    token_s: float  # per new token: projections and MLP
    pair_s: float  # per (new token, key it attends to): attention
    cached_token_s: float  # per cached token assembled
    cached_fixed_s: float = 0.0  # per assembly with cached tokens in it, beyond the plain one's

    def forward(self, num_new: int, num_context: int) -> float:
        # new tokens see the context and, causally, half of each other on average
        return self.fixed_s + self.token_s * num_new + self.pair_s * num_new * (num_context + num_new / 2)

    def cached(self, num_cached: int, num_new: int) -> float:
        return self.cached_fixed_s + self.cached_token_s * num_cached + self.forward(num_new, num_cached)

    def full(self, num_tokens: int) -> float:
        return self.forward(num_tokens, 0)

    def carrying(self, num_new: int, num_context: int, rows: Sequence[int]) -> float:
        """A prefill forward that also carries one decode token for each of `rows` (the KV length each
        row attends to, its new token aside): the rows share the forward's fixed cost and add their token
        and their attention to it, as a row of `num_new` would."""
        return self.forward(num_new, num_context) + sum(self.forward(1, n) - self.fixed_s for n in rows)

    def paced(self, factor: float) -> Costs:
        """These costs on a machine that runs `factor` times as slow: every part, since assembly is CPU work
        too. The cached-or-full choice, both sides on this machine, stays; loading over a link does not slow
        with the CPU, so load-or-recompute moves."""
        return replace(self, fixed_s=self.fixed_s * factor, token_s=self.token_s * factor,
                       pair_s=self.pair_s * factor, cached_token_s=self.cached_token_s * factor,
                       cached_fixed_s=self.cached_fixed_s * factor)


class PaceMeter:
    """How long this machine's prefills take now against the calibrated model of them: a moving average
    of measured / modelled seconds (1.0: as calibrated). Pure bookkeeping, thread-safe.

    Prefills are summed into a span until its measured or its modelled seconds reach `MIN_SPAN_S`, then the
    span's ratio is one sample: the first replaces the calibration's 1.0 (the machine as it is now), later
    ones move a moving average of log-ratios by `PACE_ALPHA`. A span that measured no time at all (a
    clock that did not step) keeps collecting; a sample is held within `1 / PACE_LIMIT .. PACE_LIMIT`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._log_factor: float | None = None
        self._measured = self._modelled = 0.0
        self.num_samples = 0

    @property
    def factor(self) -> float:
        with self._lock:
            return 1.0 if self._log_factor is None else math.exp(self._log_factor)

    def ran(self, modelled_s: float, seconds: float) -> None:
        """A prefill the calibrated costs put at `modelled_s` took `seconds`."""
        if modelled_s <= 0 or seconds < 0:
            return
        with self._lock:
            self._measured += seconds
            self._modelled += modelled_s
            if max(self._measured, self._modelled) < MIN_SPAN_S or self._measured <= 0:
                return
            ratio = min(max(self._measured / self._modelled, 1 / PACE_LIMIT), PACE_LIMIT)
            self._measured = self._modelled = 0.0
            sample = math.log(ratio)
            self._log_factor = (sample if self._log_factor is None
                                else (1 - PACE_ALPHA) * self._log_factor + PACE_ALPHA * sample)
            self.num_samples += 1

    def reset(self) -> None:
        """Back to the calibration's 1.0, no samples: the costs were measured again just now."""
        with self._lock:
            self._log_factor, self._measured, self._modelled, self.num_samples = None, 0.0, 0.0, 0


class FixedPace:
    """Pacing off: the costs stay as measured (a caller that gives costs it knows to be this machine's)."""

    factor = 1.0
    num_samples = 0

    def ran(self, modelled_s: float, seconds: float) -> None:
        pass

    def reset(self) -> None:
        pass


class Fallback:
    """The engine's path policy; in `auto`, its costs are measured (or read) on the first decision and
    then follow the prefills and encodings this engine runs (`ran`, `encoded`)."""

    def __init__(self, policy: str | None, measure: Callable[[], Costs] | None = None,
                 pace: PaceMeter | FixedPace | None = None, *,
                 remeasure: Callable[[], Costs | None] | None = None) -> None:
        """`measure`: called once, on the first `auto` decision (None: keep the cached plan, unmeasured).
        `pace`: how the costs follow the machine (None: a new `PaceMeter`; `FixedPace()`: they do not).
        `remeasure`: a fresh calibration, once, where the pace drifts `DRIFT` times from the costs (None:
        `measure` again); it may return None where now is no time to measure (a busy CPU)."""
        self.policy = fallback_policy(policy)
        self._measure = measure if self.policy == "auto" else None
        self._remeasure = (remeasure or measure) if self._measure is not None else None
        self._costs: Costs | None = None
        self._drifted = False
        self._drift_threads = 0  # torch threads of the request that saw the drift
        self._lock = threading.RLock()
        self.pace = PaceMeter() if pace is None else pace
        self.num_recalibrations = 0
        # called where the pace drifted: whoever set it runs `recalibrate` off the request's path (the engine's
        # background encoder, in idle time); None: the next decision measures, inside its request
        self.on_drift: Callable[[], None] | None = None

    @property
    def calibrated(self) -> Costs | None:
        """The costs as measured (or read) once, before any pacing; measured again once where the pace drifted."""
        if (self._costs is None and self._measure is not None) or (self._drifted and self.on_drift is None):
            with self._lock:
                if self._costs is None and self._measure is not None:
                    self._costs = self._measure()
                else:
                    self.recalibrate()
        return self._costs

    def recalibrate(self) -> bool:
        """Measure the costs again now if the pace drifted since they were measured → whether it did. The
        paced costs serve until then."""
        with self._lock:
            if not self._drifted or self._remeasure is None:
                return False
            self._drifted = False
            with torch_threads(self._drift_threads):
                fresh = self._remeasure()
            if fresh is not None:
                self._costs = fresh
                self.num_recalibrations += 1
                self.pace.reset()
            return True

    def _check_drift(self) -> None:
        # the moving average, not one sample: a burst of load moves one sample, not DRIFT_SAMPLES of them
        if (self.num_recalibrations == 0 and self._remeasure is not None and self.pace.num_samples >= DRIFT_SAMPLES
                and not self._drifted and not 1 / DRIFT <= self.pace.factor <= DRIFT):
            # the requests' count, before the drift is seen: another thread (the background encoder's) may
            # run with another, and the stored costs are keyed by it
            self._drift_threads = torch.get_num_threads()
            self._drifted = True
            if self.on_drift is not None:
                self.on_drift()

    @property
    def costs(self) -> Costs | None:
        """The calibrated costs at this machine's present pace (`PaceMeter`)."""
        costs = self.calibrated
        return None if costs is None else costs.paced(self.pace.factor)

    def ran(self, num_new: int, num_context: int, seconds: float, rows: Sequence[int] = ()) -> None:
        """A prefill forward of `num_new` tokens against `num_context` cached ones took `seconds`: a pace
        sample, where costs were calibrated already (a prefill never triggers a calibration). `rows`: the
        decode rows the same forward carried (the batcher's mixed step), each by the KV length it
        attended to; their share of the seconds is modelled with them (`Costs.carrying`)."""
        if self._costs is not None:
            self.pace.ran(self._costs.carrying(num_new, num_context, rows), seconds)
            self._check_drift()

    def encoded(self, lengths: Sequence[int], seconds: float) -> None:
        """Modules of these token counts were encoded (recomputed) in `seconds`: a pace sample against what
        the planner expects of recomputing each (`Costs.full`), where costs were calibrated already."""
        if self._costs is not None:
            self.pace.ran(sum(self._costs.full(n) for n in lengths), seconds)
            self._check_drift()

    def use_full(self, num_tokens: int, num_cached: int, *, num_new: int | None = None,
                 num_reused_full: int = 0, num_full: int | None = None) -> bool:
        """Whether a full prefill beats assembling `num_cached` of the plan's `num_tokens` and computing the rest.
        The full prefill has `num_full` tokens (None: `num_tokens`; fewer where the plan adds link tokens).
        The prefix cache (engine/prefix/prefix_cache.py) may hold some of either path's tokens: `num_new` is what
        the cached plan computes after taking them (None: `num_tokens - num_cached`), `num_reused_full` how
        many of the full prefill's it holds (those are assembled, not computed)."""
        if self.policy != "auto" or num_cached == 0:
            return self.policy == "always" or num_cached == 0
        costs = self.costs
        if costs is None or costs.token_s <= 0:
            return False
        new = num_tokens - num_cached if num_new is None else num_new
        num_full = num_tokens if num_full is None else num_full
        full = (costs.cached(num_reused_full, num_full - num_reused_full) if num_reused_full
                else costs.full(num_full))
        return costs.cached(num_tokens - new, new) > (1 + MARGIN) * full


def cpu_busy() -> bool:
    """Whether other work holds this CPU: a 1-minute load average over `BUSY_LOAD` times its cores (a
    calibration's own threads load it about once). False where the load cannot be read."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return load > BUSY_LOAD * cores


def stored_costs(model: PreTrainedModel, relocator: Relocator, geometry: KVGeometry, fingerprint: str) -> Costs:
    """This machine's `Costs` for the model: read from the cache home, or calibrated now and written there
    (a cache home that cannot be written only costs a calibration per engine, with one warning). A
    calibration stored while the CPU was busy is measured again, once, when it no longer is: one busy
    moment's coefficients are not uniformly slower (the pace scales all of them alike), and kept for
    good they would decide every later engine's choice between cached and full prefill."""
    what, path = _stored_at(model, fingerprint)
    try:
        saved = json.loads(path.read_text())
        if saved.get("version") == VERSION and saved.get("key") == what:
            if not (saved.get("cpu_busy") and not cpu_busy()):  # stored busy only on a CPU
                return Costs(**saved["costs"])
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, KeyError) as e:  # unreadable or from another version: measure again
        warnings.warn(f"ignoring the stored prefill costs at {path} ({e}); measuring again", RuntimeWarning, stacklevel=2)
    return _measure_and_store(model, relocator, geometry, what, path)


def recalibrated_costs(model: PreTrainedModel, relocator: Relocator, geometry: KVGeometry,
                       fingerprint: str) -> Costs | None:
    """This machine's `Costs` measured again and stored in place of the old ones, because the pace of
    the prefills actually run drifted far from them (`Fallback`); None on a CPU other work holds now:
    that moment's costs would be no better."""
    if model.device.type == "cpu" and cpu_busy():
        return None
    return _measure_and_store(model, relocator, geometry, *_stored_at(model, fingerprint))


def _stored_at(model: PreTrainedModel, fingerprint: str) -> tuple[str, Path]:
    what = f"{fingerprint}|{model.device}|{model.dtype}|{torch.get_num_threads()}"
    return what, costs_dir() / f"{hashlib.sha256(what.encode()).hexdigest()[:24]}.json"


def _measure_and_store(model: PreTrainedModel, relocator: Relocator, geometry: KVGeometry, what: str,
                       path: Path) -> Costs:
    on_cpu = model.device.type == "cpu"
    busy = on_cpu and cpu_busy()
    costs = calibrate(model, relocator, geometry)
    busy = busy or (on_cpu and cpu_busy())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": VERSION, "key": what, "costs": asdict(costs), "cpu_busy": busy}))
        tmp.replace(path)
    except OSError as e:
        warnings.warn(f"could not store the prefill costs at {path} ({e}); they are measured per engine",
                      RuntimeWarning, stacklevel=3)
    return costs


@torch.inference_mode()
def calibrate(model: PreTrainedModel, relocator: Relocator, geometry: KVGeometry, repeats: int = 2) -> Costs:
    """Time full prefills of SHORT and LONG tokens, SHORT tokens against CONTEXT cached ones, and the
    assembly of CONTEXT tokens (each the best of `repeats`, after one warm-up), and solve for `Costs`. One
    timing is the mean of as many calls as span `MIN_STEPS` steps of the clock: a tiny model's forward
    is shorter than a coarse clock's step."""
    device, dtype, config = model.device, model.dtype, model.config
    vocab = int(getattr(config.get_text_config(), "vocab_size", 1000))
    ids = torch.randint(3, max(4, vocab), (CONTEXT + SHORT,), generator=torch.Generator().manual_seed(0)).tolist()
    shape = (geometry.num_layers, geometry.num_kv_heads, CONTEXT, geometry.head_dim)
    # the context where the default store keeps modules: on a GPU, pinned host memory, so assembly's cost is
    # the host link's (engine/kv/stream.py), measured on the device itself
    home = torch.device("cpu") if device.type == "cuda" else device
    keys, values = torch.randn(shape, dtype=dtype, device=home) * 0.1, torch.randn(shape, dtype=dtype, device=home)
    if device.type == "cuda":
        keys, values = keys.pin_memory(), values.pin_memory()
    kv = ModuleKV(keys, values, 0, tuple(ids[:CONTEXT]), "calibration", "isolated")
    # the context moved by a few positions, as a retrieved module is: assembly rotates its keys. Keys of
    # learned absolute positions (GPT-2, OPT) are reused only where they were encoded, so there it stays.
    shift = SHORT if relocator.relocatable else 0
    with_context = [Piece(tuple(ids[:CONTEXT]), shift, "m"), Piece(tuple(ids[CONTEXT:]), CONTEXT + shift)]

    min_span_s = MIN_STEPS * process_resolution()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def best(fn) -> float:
        fn()  # warm-up: buffer pool, packed weights, kernels
        return min(repeat(fn, min_span_s, before=sync).seconds for _ in range(repeats))

    def assembled(num: int) -> Callable[[], None]:
        pieces = [Piece(tuple(ids[:num]), shift, "m"), Piece(tuple(ids[CONTEXT:]), num + shift)]
        part = ModuleKV(kv.keys[:, :, :num], kv.values[:, :, :num], 0, tuple(ids[:num]), "calibration", "isolated")
        def go() -> None:  # the whole copy, even where the prefill would wait for it layer by layer
            cache = assemble_for(pieces, {"m": part}, relocator, config, geometry, device, dtype).cache
            load_all(cache)
            release(cache)
        return go

    def run(pieces: list[Piece], kvs: dict[str, ModuleKV]) -> None:
        asm = assemble_for(pieces, kvs, relocator, config, geometry, device, dtype)
        forward_last(model, asm.new_ids, asm.new_positions, asm.cache, asm.mask)
        release(asm.cache)

    t_short = best(lambda: run([Piece(tuple(ids[:SHORT]), 0)], {}))
    t_long = best(lambda: run([Piece(tuple(ids[:LONG]), 0)], {}))
    t_plain = best(lambda: release(assemble(with_context[1:], {}, relocator, config, geometry, device, dtype).cache))
    t_asm_short, t_asm = best(assembled(SHORT)), best(assembled(CONTEXT))
    t_ctx = best(lambda: run(with_context, {"m": kv})) - (t_asm - t_plain)
    # t_ctx - t_short = pair * SHORT * CONTEXT; then two sizes without context give token_s and fixed_s
    pair = max(0.0, (t_ctx - t_short) / (SHORT * CONTEXT))
    token = max(0.0, (t_long - t_short - pair * (LONG * LONG - SHORT * SHORT) / 2) / (LONG - SHORT))
    fixed = max(0.0, t_short - token * SHORT - pair * SHORT * SHORT / 2)
    per_cached = max(0.0, (t_asm - t_asm_short) / (CONTEXT - SHORT))
    return Costs(fixed, token, pair, per_cached, max(0.0, t_asm_short - t_plain - per_cached * SHORT))
