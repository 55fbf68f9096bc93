"""Planning a request: a prompt → its token pieces, and the KV of every module it uses (`Plan`).

`Planner.plan` compiles the prompt against its schema, checks it fits the context window, fetches each
module's KV from the store, and handles the ones missing (a miss: never encoded, evicted, corrupt, or
made by another model; the key is content-addressed, so that is a miss too) one of two ways:
- deferred (`misses="defer"`, what a corpus's engine does): the module's tokens are computed in this request's
  prefill, against the modules before it as a full prefill computes them, and the module is handed to
  the background encoder (engine/planning/background.py), which stores it while no request runs. No
  question waits for an encoding, and the cost model still picks the sooner of this plan and full prefill;
- encoded (`misses="encode"`): encoded on its own and stored before the request goes on, so the
  request reads it exactly as later ones will (what `eval` measures).
Under `defer`, a module whose schema keeps two entries (`ast.Schema.neighbours_present`) and whose entry encoded
after its neighbours is not stored yet reads its plain entry, as a prompt without those neighbours would, and
the other is queued for the background encoder: a corpus writes only the plain entries at ingest.
It then turns modules that cannot move to their place here (learned absolute positions) into new
tokens, and applies the quality recovery (engine/planning/recovery.py). The plan is the request's one
record from here to its `Result`.

Out of scope: assembling the KV and running the prefill (engine/planning/prefill.py), decoding (engine/decoding/state.py,
engine/decoding/decode.py), the schema registry (engine/prompt/schemas.py), earlier requests' KV: the plan is made
as if there were none, and the prefill takes the longest prefix an earlier request computed the same
way (engine/prefix/prefix_cache.py), which `sources` lets it tell.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rag_promptcache.engine.kv import byproduct
from rag_promptcache.engine.kv.byproduct import Byproduct
from rag_promptcache.engine.prompt.compiler import ROOT, Compiler, Layout, Piece, Unit, plain, read_as
from rag_promptcache.engine.planning.background import MISSES, Job
from rag_promptcache.engine.planning.costmodel import Fallback
from rag_promptcache.engine.planning.encoder import encode_units
from rag_promptcache.engine.errors import ContextWindowExceeded
from rag_promptcache.engine.prefix.prefix_cache import Label, token_labels
from rag_promptcache.engine.planning.recovery import Recovery, recover
from rag_promptcache.engine.result import Result
from rag_promptcache.engine.prompt.schemas import Schemas
from rag_promptcache.model.positions import KVGeometry, Relocator
from rag_promptcache.pml import ast
from rag_promptcache.store.base import ModuleKV, Store

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from rag_promptcache.engine.decoding.state import DecodeState


@dataclass(frozen=True, slots=True)
class Plan:
    pieces: tuple[Piece, ...]
    kvs: dict[str, ModuleKV]
    hits: tuple[str, ...]
    misses: tuple[str, ...]
    recomputed: tuple[str, ...]
    num_encoded_tokens: int  # tokens of the missed modules, encoded by this request
    # the store key of each module it assembles: with the pieces, how each token's KV is produced, the
    # prefix cache's labels (engine/prefix/prefix_cache.py); None: a full-prefill reference, which reuses nothing
    sources: Mapping[str, str] | None = None
    path: str = "cached"  # "full": every token computed (use_cache=False, or the fallback chose it)
    # missed modules computed in this request's prefill, queued for the background encoder (unless held but slower to load)
    deferred: tuple[str, ...] = ()
    # those of them whose entry is this prefill's own KV, kept once the answer is done (engine/kv/byproduct.py)
    byproducts: tuple[Byproduct, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.pieces)

    @property
    def num_cached(self) -> int:
        """Tokens assembled from module KV, whether fetched from the store or encoded just now."""
        return sum(len(p.token_ids) for p in self.pieces if p.cached)

    @property
    def num_from_store(self) -> int:
        """Tokens served from stored KV (hits only): what `Result.cached_tokens` reports. A missed
        module's KV was computed in this request, so its tokens count as computed."""
        hits = set(self.hits)
        return sum(len(p.token_ids) for p in self.pieces if p.cached and p.unit in hits)

    @property
    def next_position(self) -> int:
        """The position of the answer's first token."""
        return max(p.position + len(p.token_ids) for p in self.pieces)

    def num_from_store_after(self, num_tokens: int) -> int:
        """`num_from_store` past the first `num_tokens` tokens (those came from the prefix cache)."""
        hits = set(self.hits)
        seq = out = 0
        for p in self.pieces:
            n = len(p.token_ids)
            if p.cached and p.unit in hits:
                out += n - min(max(num_tokens - seq, 0), n)
            seq += n
        return out

    def result(self, state: DecodeState, total_s: float, num_prefix_tokens: int = 0, adapter: str | None = None) -> Result:
        """The `Result` of a finished decode of this plan (the engine's loop and the batcher's), whose
        first `num_prefix_tokens` tokens' KV came from the prefix cache, by a model with `adapter` merged."""
        assert state.finish is not None, f"{state.finish=}"
        cached = num_prefix_tokens + self.num_from_store_after(num_prefix_tokens)
        return Result(
            text=state.text.text if state.text is not None else "",
            token_ids=tuple(state.tokens),
            finish_reason=state.finish,
            ttft_s=state.ttft_s,
            total_s=total_s,
            prompt_tokens=self.num_tokens,
            cached_tokens=cached,
            # every prompt token is either served from a cache (the store, the prefix cache) or computed
            # here, once: a missed module that recovery also recomputes is not counted twice (issue 25 item 12)
            computed_tokens=self.num_tokens - cached,
            hit_modules=tuple(n for n in self.hits if n != ROOT),
            missed_modules=tuple(n for n in self.misses if n != ROOT),
            deferred_modules=tuple(n for n in self.deferred if n != ROOT),
            recomputed_modules=tuple(n for n in self.recomputed if n != ROOT),
            num_decode_forwards=state.stats.num_forwards,
            num_prefix_tokens=num_prefix_tokens,
            # a prompt that imports no module and reuses no earlier request's tokens is a plain full prefill
            path="full" if not cached and not any(p.cached for p in self.pieces) else self.path,  # type: ignore[arg-type]
            adapter=adapter,
        )


def uncached(plan: Plan) -> Plan:
    """The same token sequence with every piece computed: the full-prefill reference."""
    merged = Piece(tuple(t for p in plan.pieces for t in p.token_ids), plan.pieces[0].position)
    contiguous = all(
        b.position == a.position + len(a.token_ids) for a, b in zip(plan.pieces, plan.pieces[1:])
    )
    pieces = (merged,) if contiguous else tuple(Piece(p.token_ids, p.position) for p in plan.pieces if p.token_ids)
    return Plan(pieces, {}, (), (), (), 0, sources=None, path="full")


# recoveries that read only the modules' order, so a module computed in the prefill simply counts as recomputed;
# the others probe every module's stored KV, so their misses are encoded first
DEFERRABLE = ("none", "last", "tail", "first_k")


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """What a planner needs of its engine, fixed at the engine's construction."""

    mode: str
    layout: Layout
    batch_size: int  # modules encoded per forward
    recovery: Recovery  # the default; a request may name another
    context_window: int
    fingerprint: str
    fallback: Fallback | None = None  # None: always the cached plan (engine/planning/costmodel.py)


class Planner:
    def __init__(self, schemas: Schemas, compiler: Compiler, store_of: Callable[[str], Store], model: PreTrainedModel,
                 relocator: Relocator, geometry: KVGeometry, config: PlanConfig, model_lock: threading.RLock,
                 reusable: Callable[[Sequence[Label]], int] | None = None) -> None:
        """`store_of`: the store a schema's modules live in, by schema name (`PromptCache.store_of`).
        `reusable`: how many tokens of a prompt with these labels the prefix cache would give its
        prefill now (None: none), for the cost model."""
        self.schemas, self.compiler, self.store_of, self.model = schemas, compiler, store_of, model
        self.relocator, self.geometry, self.config = relocator, geometry, config
        self.model_lock = model_lock  # held around every forward: encoding misses, recovery passes
        self.reusable = reusable
        # store key -> the result of the request encoding it now (`encode_once`); plan() is never called
        # under model_lock, so a waiter never holds what the encoder needs
        self._encoding: dict[str, Future[ModuleKV]] = {}
        self._encoding_lock = threading.Lock()
        self.num_shared_encodes = 0  # misses answered by another request's encoding
        # where deferred misses go (the engine's `BackgroundEncoder.submit`; None: nowhere, they are computed in the
        # request only), and the policy of a request that names none (the engine's `misses`)
        self.defer: Callable[[Sequence[Job]], int] | None = None
        self.default_misses = "encode"

    def plan(self, prompt: str | ast.Prompt, *, use_cache: bool = True, recovery: str | Recovery | None = None,
             max_new_tokens: int = 0, fallback: bool = True, misses: str | None = None) -> Plan:
        """Compile the prompt and fetch the KV of every module it uses. Raises `ContextWindowExceeded` if
        the prompt plus `max_new_tokens` does not fit the model's context window.
        `fallback`: let the engine's policy (engine/planning/costmodel.py) swap the plan for a full prefill of the
        same tokens where that is faster. `misses`: "defer" or "encode" (the module docstring); None: the
        planner's `default_misses`."""
        cfg = self.config
        if misses not in (None, *MISSES):
            raise ValueError(f"unknown misses policy {misses!r}; valid: {', '.join(MISSES)}")
        out = self.schemas.compile_prompt(prompt, cfg.layout)
        compiled, pieces, chat, default = out.schema, list(out.pieces), out.chat, out.default_system
        if not pieces or not any(p.token_ids for p in pieces):
            raise ValueError("empty prompt: it compiles to no tokens")
        self.check_window(pieces, max_new_tokens)
        if not use_cache:
            return uncached(Plan(tuple(pieces), {}, (), (), (), 0))
        if pieces[-1].cached:  # the last token's logits are needed: compute it
            last = pieces.pop()
            if len(last.token_ids) > 1:
                pieces.append(Piece(last.token_ids[:-1], last.position, last.unit, last.offset))
            pieces.append(Piece(last.token_ids[-1:], last.position + len(last.token_ids) - 1))
        recomputed: list[str] = []
        end = max(p.position + len(p.token_ids) for p in pieces)
        bound = self.relocator.exact_below
        if not self.relocator.relocatable or (bound is not None and end >= bound):
            # a moved module's keys would be wrong here: compute its tokens in the prefill instead
            for i, p in enumerate(pieces):
                unit = compiled.units[p.unit] if p.cached else None
                if unit is not None and p.position != unit.encode_start + p.offset:
                    pieces[i] = Piece(p.token_ids, p.position)
                    recomputed.append(unit.name)
        needed = list(dict.fromkeys(p.unit for p in pieces if p.cached))
        units = {name: read_as(compiled.units[name], set(needed)) for name in needed}  # plain where neighbours are absent
        keys = {name: self.schemas.key(compiled, units[name], chat, default) for name in needed}
        kvs: dict[str, ModuleKV] = {}
        missing: list[Unit] = []
        stored_anyway: set[str] = set()
        store = self.store_of(compiled.name)
        deferring = (misses or self.default_misses) == "defer"
        better: list[Job] = []  # entries encoded after neighbours, not stored yet: the plain one read now

        def stored(unit: Unit) -> ModuleKV | None:
            kv = store.get(keys[unit.name])
            # keys are content addresses; this re-checks what the entry says of itself, so a foreign
            # entry planted under our key is recomputed, never used
            same = kv is not None and (kv.token_ids, kv.fingerprint, kv.mode) == (unit.token_ids, cfg.fingerprint, cfg.mode)
            return kv if same else None

        for name in needed:
            unit = units[name]
            if self.recompute_sooner(store, keys[name], len(unit.token_ids)):
                missing.append(unit)
                stored_anyway.add(name)
                continue
            kv = stored(unit)
            if kv is None and deferring and unit.neighbour_ids and unit.neighbours_present:
                # a corpus that keeps both entries writes this one in idle time: read its plain entry (or miss
                # it) as a prompt without its neighbours would, and have this one encoded off the request's path
                better.append(Job(keys[name], unit, len(unit.token_ids), store))
                unit = units[name] = plain(unit)
                keys[name] = self.schemas.key(compiled, unit, chat, default)
                kv = stored(unit)
            if kv is None:
                missing.append(unit)
            else:
                kvs[name] = kv
        chosen = cfg.recovery if recovery is None else Recovery.parse(recovery)
        # every module in sequence order, before a deferred miss becomes new tokens: `last:N` counts those among the N
        order = list(dict.fromkeys(p.unit for p in pieces if p.cached and p.unit != ROOT))
        deferred: list[Unit] = []
        kept: list[Byproduct] = []
        to_encode = missing
        if missing and chosen.kind in DEFERRABLE and deferring:
            # computed in this prefill against what precedes them; stored later, off the request's path
            computed = {u.name for u in missing}
            if any(u.byproduct for u in missing) and byproduct.supported(self.relocator, self.geometry, end):
                at = byproduct.located(pieces, [u for u in missing if u.byproduct and u.name not in stored_anyway])
                kept = [Byproduct(keys[n], units[n], seq, pos, store) for n, (seq, pos) in at.items()]
            pieces = [Piece(p.token_ids, p.position) if p.unit in computed else p for p in pieces]
            deferred, to_encode = missing, []  # what the store holds but loads slower than this is not queued
        encoded = 0
        for u, kv in zip(to_encode, self.encode_once(store, to_encode, keys, stored_anyway)):
            kvs[u.name] = kv
            encoded += kv.num_tokens
        # the full prefill of this prompt: its own tokens, without any link tokens recovery adds
        full = uncached(Plan(tuple(pieces), {}, (), (), (), 0))
        with self.model_lock:
            pieces = recover(chosen, pieces, kvs, self.model, self.relocator, self.geometry, order=order)
        self.check_window(pieces, max_new_tokens)  # link tokens lengthen the prompt
        missed = {u.name for u in missing}
        plan = Plan(tuple(pieces), kvs, tuple(n for n in needed if n not in missed),
                    tuple(u.name for u in missing), tuple(dict.fromkeys(recomputed)), encoded, keys,
                    deferred=tuple(u.name for u in deferred), byproducts=tuple(kept))
        if (deferred or better) and self.defer is not None:
            later = stored_anyway | {b.unit.name for b in kept}  # a by-product entry is queued after the answer
            self.defer([*(Job(keys[u.name], u, len(u.token_ids), store) for u in deferred if u.name not in later), *better])
        if fallback and cfg.fallback is not None and self._full_pays(plan, full, cfg.fallback):
            # every token computed; sources={} (no cached unit): such a plan may still reuse, exactly, what
            # an earlier full-path request computed of the same tokens (the prefix cache's labels)
            return dataclasses.replace(full, misses=plan.misses, num_encoded_tokens=encoded, sources={},
                                       deferred=plan.deferred, byproducts=plan.byproducts)
        return plan

    def keep_byproducts(self, plan: Plan, pieces: Sequence[Piece], keys: Sequence[torch.Tensor],
                        values: Sequence[torch.Tensor], length: int) -> int:
        """Queue `plan`'s by-product entries, from its finished request's cache as assembled from `pieces`
        (per layer [H, capacity, D], `length` tokens written) → how many were queued."""
        if not plan.byproducts or self.defer is None:
            return 0
        made = byproduct.entries(plan.byproducts, pieces, keys, values, length, self.relocator,
                                 self.config.fingerprint, self.config.mode)
        return self.defer([Job(b.key, b.unit, kv.num_tokens, b.store, kv) for b, kv in made])

    def _full_pays(self, plan: Plan, full: Plan, fallback: Fallback) -> bool:
        """The cost model's choice between `plan` and `full`, its full prefill, counting what the prefix
        cache holds of either path."""
        if self.reusable is None or fallback.policy != "auto":
            return fallback.use_full(plan.num_tokens, plan.num_cached, num_full=full.num_tokens)
        reused = self.reusable(token_labels(plan.pieces, plan.sources or {}))
        seq = num_new = 0
        for p in plan.pieces:  # new tokens past the reused prefix: what the cached plan still computes
            n = len(p.token_ids)
            if not p.cached:
                num_new += n - min(max(reused - seq, 0), n)
            seq += n
        return fallback.use_full(plan.num_tokens, plan.num_cached, num_new=num_new, num_full=full.num_tokens,
                                 num_reused_full=self.reusable(token_labels(full.pieces, {})))

    def recompute_sooner(self, store: Store, key: str, num_tokens: int) -> bool:
        """Whether computing a module from its text is expected to finish before loading it: the store's
        measured link (a slow Redis) against this machine's forward cost at its present pace. Only under
        the `auto` fallback policy, whose costs it reuses; a store without estimates always loads."""
        fallback = self.config.fallback
        load_s = getattr(store, "load_s", None)
        if fallback is None or load_s is None:
            return False
        costs = fallback.costs
        estimate = load_s(key, num_tokens) if costs is not None else None
        return estimate is not None and estimate > costs.full(num_tokens)

    def encode_once(self, store: Store, units: Sequence[Unit], keys: Mapping[str, str],
                    unstored: set[str]) -> list[ModuleKV]:
        """The KV of missed `units` (stored into `store`), each encoded once however many requests miss it at the same time:
        the first encodes (all of its own in one batch) and stores it (unless in `unstored`: recomputing
        was chosen over loading it), the others wait for its result. A unit stored meanwhile is read back."""
        mine: list[Unit] = []
        waits: dict[str, Future[ModuleKV]] = {}
        with self._encoding_lock:
            for u in units:
                pending = self._encoding.get(keys[u.name])
                if pending is None:
                    self._encoding[keys[u.name]] = Future()
                    mine.append(u)
                else:
                    waits[u.name] = pending
        out: dict[str, ModuleKV] = {}
        try:
            todo = []
            for u in mine:  # another request may have stored it between our miss and our claim
                kv = None if u.name in unstored else store.get(keys[u.name])
                if kv is not None and (kv.token_ids, kv.fingerprint) == (u.token_ids, self.config.fingerprint):
                    out[u.name] = kv
                else:
                    todo.append(u)
            for u, kv in zip(todo, self.encode(todo)):
                if u.name not in unstored:
                    store.put(keys[u.name], kv)
                out[u.name] = kv
        except BaseException as e:
            with self._encoding_lock:
                for u in mine:
                    self._encoding.pop(keys[u.name]).set_exception(e)
            raise
        with self._encoding_lock:
            for u in mine:
                self._encoding.pop(keys[u.name]).set_result(out[u.name])
        self.num_shared_encodes += len(waits)
        failed = []
        for u in units:
            if u.name in waits:
                if waits[u.name].exception() is None:  # waits for the other request's encoding
                    out[u.name] = waits[u.name].result()
                else:  # that request failed (or was stopped): this one encodes it itself
                    failed.append(u)
        for u, kv in zip(failed, self.encode(failed)):
            out[u.name] = kv
        return [out[u.name] for u in units]

    def encode(self, units: Sequence[Unit]) -> list[ModuleKV]:
        """The KV of `units`, computed now (not stored: the caller knows their keys)."""
        if not units:
            return []
        with self.model_lock:
            t0 = time.perf_counter()
            kvs = encode_units(self.model, units, mode=self.config.mode, fingerprint=self.config.fingerprint,
                               batch_size=self.config.batch_size, relocator=self.relocator)
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            seconds = time.perf_counter() - t0
        if self.config.fallback is not None:  # what recomputing costs now: the planner's next choices follow it
            self.config.fallback.encoded([len(u.token_ids) for u in units], seconds)
        return kvs

    def check_window(self, pieces: Sequence[Piece], max_new_tokens: int) -> None:
        # positions, not token counts: the schema layout leaves gaps, and RoPE tables end at the window
        end = max(p.position + len(p.token_ids) for p in pieces)
        window = self.config.context_window
        if end + max_new_tokens > window:
            num_tokens = sum(len(p.token_ids) for p in pieces)
            where = "" if end == num_tokens else f" reaching position {end}"
            raise ContextWindowExceeded(
                f"prompt of {num_tokens} tokens{where} plus max_new_tokens={max_new_tokens} is "
                f"{end + max_new_tokens}, past the model's {window}-token context window; "
                "shorten the prompt (fewer or smaller modules) or lower max_new_tokens",
                max_new_fits=window - end if window > end else None,
            )
