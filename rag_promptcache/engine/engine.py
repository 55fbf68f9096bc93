"""`PromptCache`: the engine. PML prompt → plan (hit / miss per module) → assemble → prefill → decode.

Each step is owned once, elsewhere; this class wires them over one model and one store:
- the schema registry (engine/prompt/schemas.py) and the planner (engine/planning/plan.py): a module whose KV is
  missing from the store is computed in the request's prefill and queued for the background encoder
  (engine/planning/background.py), which writes it (or that prefill's own KV of it, engine/kv/byproduct.py)
  to the store while no request runs (`misses="encode"`: encoded in the request, used and written back first).
  On a model with learned absolute positions a module is reused only where it was encoded (else recomputed);
- the prefill (engine/planning/prefill.py), then the request's `DecodeState` (engine/decoding/state.py) driven by the
  single-request loop (engine/decoding/decode.py) or, through `scheduler()`, by the batcher (engine/batching/batcher.py).

Out of scope here: retrieval (rag/), storage tiers (store/), positions per architecture (model/).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING

import torch

from rag_promptcache.engine.compute import attention
from rag_promptcache.engine.compute.runner import decoder_layers, lean_forward
from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.engine.batching.batcher import DEFAULT_ADMISSION, DEFAULT_PREFILL_CHUNK, Batcher
from rag_promptcache.engine.prompt.compiler import LAYOUTS, Compiler, Layout
from rag_promptcache.engine.planning.costmodel import Costs, Fallback, recalibrated_costs, stored_costs
from rag_promptcache.engine.decoding.decode import can_crop, decode
from rag_promptcache.engine.planning.encoder import DEFAULT_MODE, check_mode
from rag_promptcache.engine.decoding.grammar import Grammar
from rag_promptcache.engine.decoding.lookup import lookup_tokens
from rag_promptcache.engine.planning.background import Activity, BackgroundEncoder, misses_policy, yield_between
from rag_promptcache.engine.planning.plan import Plan, PlanConfig, Planner, uncached
from rag_promptcache.engine.planning.prefill import Prefilled, Prefilling, start
from rag_promptcache.engine.prefix.prefix_cache import PrefixUse, cache_layers, make_prefix_cache, token_labels
from rag_promptcache.engine.planning.recovery import DEFAULT_RECOVERY, Recovery
from rag_promptcache.engine.result import AsyncStream, Comparison, EncodeReport, Result, Stream
from rag_promptcache.engine.decoding.sampling import Sampling, eos_token_ids
from rag_promptcache.engine.prompt.schemas import Schemas
from rag_promptcache.engine.decoding.state import DecodeState
from rag_promptcache.engine.decoding.text import TextStream
from rag_promptcache.model import links
from rag_promptcache.model.adapter import applied
from rag_promptcache.model.chat import role_markup
from rag_promptcache.model.loading import load_model, model_fingerprint
from rag_promptcache.model.positions import kv_geometry, relocator_for
from rag_promptcache.pml import ast
from rag_promptcache.store.base import Store
from rag_promptcache.store.config import load_config

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class PromptCache:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, store: Store | None = None,
                 mode: str = DEFAULT_MODE, layout: Layout = "contiguous", name: str | None = None, batch_size: int = 8,
                 recovery: str | Recovery | None = None, codec: str | None = None, prompt_lookup: int | None = None,
                 prefix_cache_bytes: int | None = None, fallback: str | Fallback | None = None,
                 misses: str | None = None, admission: str | None = None) -> None:
        """`recovery`: the default where a request names none; None: the recovery the model's merged adapter
        was tuned for (`model/adapter.py`), else `DEFAULT_RECOVERY`. `engine.recovery = None` goes back to that.

        `prompt_lookup`: greedy answers check up to this many tokens per forward, drafted from the prompt and
        the answer so far (engine/decoding/lookup.py); 0 turns it off; None reads RAG_PROMPTCACHE_PROMPT_LOOKUP (8).

        `prefix_cache_bytes`: the KV of recent requests kept for later ones that start the same way
        (a chat's follow-up turns; engine/prefix/prefix_cache.py), in bytes; 0 turns it off; None reads the
        store config's `prefix_cache_bytes` ($RAG_PROMPTCACHE_STORE_PREFIX_CACHE_BYTES, default 256 MiB).

        `fallback`: "auto" runs a plain full prefill where this machine's cost model (engine/planning/costmodel.py,
        measured on the first request and stored under the cache home) says it beats the cached plan,
        "never" always runs the cached plan, "always" never does; None reads RAG_PROMPTCACHE_FALLBACK
        (unset: auto); a `Fallback` is used as given (its own costs). `Result.path` says which ran.

        `misses`: "encode" (None, unless RAG_PROMPTCACHE_MISSES says otherwise) or "defer"; `admission`:
        which deferred misses the background encoder stores (engine/planning/plan.py, background.py)."""
        misses = misses_policy(misses)
        prompt_lookup = lookup_tokens(prompt_lookup)
        fallback = self._fallback_policy(fallback)  # a bad policy fails here, before anything is built
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
        if store is not None and codec is not None:  # a store holds entries in its own codec
            raise ValueError(f"codec={codec!r} applies only to the engine's default MemoryStore, not to a store you pass; set "
                             f"it on the store instead, e.g. MemoryStore(codec={codec!r}) or DiskStore(path, codec={codec!r})")
        if store is None:
            from rag_promptcache.store import MemoryStore

            store = MemoryStore(codec=codec or "native")
        self.model, self.tokenizer, self.store = model, tokenizer, store
        # stores per schema name (`attach_store`): corpora sharing this model keep their modules apart, each in its own tiers
        self._stores: dict[str, Store] = {}
        self.mode, self.layout, self.batch_size = check_mode(mode), layout, batch_size
        self.adapter = applied(model)  # the tuned adapter merged into the weights; None: the base model
        if self.adapter is not None and self.adapter.mode != self.mode:
            warnings.warn(f"adapter {self.adapter.name!r} was tuned for modules encoded in mode {self.adapter.mode!r}; "
                          f"this engine encodes them in mode {self.mode!r}, where it may answer worse than the base "
                          "model", stacklevel=2)
        self.model_name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.fingerprint = model_fingerprint(model)
        self.relocator = relocator_for(model)
        attention.available(model.dtype, model.device)  # builds the CPU kernels now where they run, not in a request
        self.geometry = kv_geometry(model)
        self.context_window = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.compiler = Compiler(tokenizer, role_markup(tokenizer), links.wrap_ids(model))
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.prompt_lookup = prompt_lookup
        prefix_cache_bytes = load_config().prefix_cache_bytes if prefix_cache_bytes is None else prefix_cache_bytes
        self.prefix_cache = make_prefix_cache(prefix_cache_bytes, self.geometry)
        # what produced a prefix's KV beyond its labels: the weights and dtype (the fingerprint), the device
        self.prefix_namespace = (self.fingerprint, str(model.device))
        # Every forward of this model runs under it (prefill, decode steps, encoding, recovery passes whose layer hooks would
        # otherwise fire in another thread's forward); reentrant: the batch scheduler holds it around calls.
        self.model_lock = threading.RLock()
        self.schemas = Schemas(self.compiler, self.fingerprint, self.mode)
        self.planner = Planner(
            self.schemas, self.compiler, self.store_of, model, self.relocator, self.geometry,
            PlanConfig(self.mode, layout, batch_size, self._default_recovery(recovery), self.context_window, self.fingerprint,
                       fallback),
            self.model_lock, lambda labels: self.prefix_cache.num_reusable(self.prefix_namespace, labels),
        )
        self.activity = Activity()  # requests in flight: the background encoder works only when there are none
        self.background = BackgroundEncoder(self.planner.encode, store, self.activity, admission=admission)
        yield_between(decoder_layers(model) or ())  # a background forward gives way between layers
        self.background.idle_steps.append(fallback.recalibrate)  # a drifted cost model is measured while idle
        fallback.on_drift = self.background.wake
        self.planner.defer, self.planner.default_misses = self.background.submit, misses

    def _default_recovery(self, spec: str | Recovery | None) -> Recovery:
        if spec is not None:
            return self._runnable(Recovery.parse(spec))
        if self.adapter is None or self.adapter.recovery is None:
            return Recovery.parse(DEFAULT_RECOVERY)
        try:
            return self._runnable(Recovery.parse(self.adapter.recovery))
        except ValueError as e:
            raise ValueError(f"adapter {self.adapter.path!r}: tune.json's recovery: {e}") from e

    def _runnable(self, recovery: Recovery) -> Recovery:
        """`recovery`, refused now where this model cannot run it (links:N without trained links)."""
        if recovery.kind == "links":
            links.ids(self.model, int(recovery.budget))
        return recovery

    @property
    def recovery(self) -> Recovery:
        """The recovery of a request that names none."""
        return self.planner.config.recovery

    @recovery.setter
    def recovery(self, spec: str | Recovery | None) -> None:
        self.planner.config = dataclasses.replace(self.planner.config, recovery=self._default_recovery(spec))

    @property
    def fallback(self) -> Fallback:
        """When a request runs a plain full prefill instead of its cached plan (`fallback=` above); assignable."""
        return self.planner.config.fallback

    @fallback.setter
    def fallback(self, policy: str | Fallback | None) -> None:
        new = self._fallback_policy(policy)
        steps = self.background.idle_steps  # the old policy's idle recalibration gives way to the new one's
        steps[steps.index(self.fallback.recalibrate)], new.on_drift = new.recalibrate, self.background.wake
        self.planner.config = dataclasses.replace(self.planner.config, fallback=new)

    def _fallback_policy(self, policy: str | Fallback | None) -> Fallback:  # a Fallback keeps its own costs
        return policy if isinstance(policy, Fallback) else Fallback(policy, self._measure_costs, remeasure=self._remeasure_costs)

    @property
    def adapter_name(self) -> str | None:
        """The merged adapter's name, as `Result.adapter` reports it; None: the base model."""
        return self.adapter.name if self.adapter is not None else None

    def _measure_costs(self) -> Costs:
        with self.model_lock:  # timed forwards: nobody else's may run meanwhile
            return stored_costs(self.model, self.relocator, self.geometry, self.fingerprint)

    def _remeasure_costs(self) -> Costs | None:
        with self.model_lock:
            return recalibrated_costs(self.model, self.relocator, self.geometry, self.fingerprint)

    @classmethod
    def from_pretrained(cls, model: str = "smollm2-135m-instruct", *, device: str | torch.device | None = None,
                        dtype: str | torch.dtype | None = None, adapter: str | os.PathLike[str] | None = "default",
                        **kwargs) -> PromptCache:
        """`dtype`: a torch dtype, or "auto" (None), "float32", "bfloat16", "float16". `adapter`: "default" (the tuned
        adapter shipped for the model, if one ships), "none"/None (the base model) or an adapter directory (`load_model`)."""
        hf_model, tokenizer = load_model(model, device=device, dtype=dtype, adapter=adapter)
        return cls(hf_model, tokenizer, name=kwargs.pop("name", model), **kwargs)

    # -- stores ----------------------------------------------------------------------------------

    def attach_store(self, name: str, store: Store) -> None:
        """Keep the modules of schema `name`, and of its twins named `name.<anything>`, in `store` instead
        of the engine's own: how several corpora share one loaded model and keep each its own tiers and
        budget. Closing `store` stays the caller's job (`detach_store` first)."""
        if "." in name:
            raise ValueError(f"a store is attached under a schema name without a dot, got {name!r}")
        if name in self._stores and self._stores[name] is not store:
            raise ValueError(f"schema {name!r} already has a store attached; detach it first")
        self._stores[name] = store

    def detach_store(self, name: str) -> Store | None:
        """Stop routing schema `name` to its attached store → that store (None: none was)."""
        return self._stores.pop(name, None)

    def store_of(self, schema_name: str) -> Store:
        """The store a schema's modules are read from and written to: the one attached under its name (or
        under the part before its first dot), else the engine's `store`."""
        return self._stores.get(schema_name.partition(".")[0], self.store)

    # -- schemas ---------------------------------------------------------------------------------

    def add_schema(self, schema: str | ast.Schema, *, replace: bool = False) -> ast.Schema:
        """Register a schema, given as PML or as a parsed `Schema`. Registering the same content
        again is a no-op; a name already registered to other content needs `replace=True`."""
        return self.schemas.add(schema, replace=replace)

    def schema(self, name: str) -> ast.Schema:
        return self.schemas.get(name)

    def encode(self, schema_name: str, module_names: Sequence[str] | None = None, *,
               progress: Callable[[int], None] | None = None) -> EncodeReport:
        """Compute and store the KV of the schema's modules (all, or the named ones) not stored yet.

        The schema's anonymous text (its root) is included when encoding all. `progress(n)` is called
        after each batch with the number of modules it encoded.
        """
        t0 = time.perf_counter()
        chat, default = self.schemas.chat_of(schema_name)
        compiled = self.schemas.compile(schema_name, chat, default)
        names = list(compiled.units) if module_names is None else list(module_names)
        for n in names:
            if n not in compiled.units:
                raise ValueError(f"schema {schema_name!r} has no module {n!r}")
        wanted = [compiled.units[n] for n in names if compiled.units[n].token_ids]
        keys = {u.name: self.schemas.key(compiled, u, chat, default) for u in wanted}
        store = self.store_of(schema_name)
        todo = [u for u in wanted if not store.contains(keys[u.name])]
        num_tokens = 0
        for b in range(0, len(todo), self.batch_size):
            batch = todo[b : b + self.batch_size]
            for u, kv in zip(batch, self.planner.encode(batch)):
                store.put(keys[u.name], kv)
                num_tokens += kv.num_tokens
            if progress is not None:
                progress(len(batch))
        return EncodeReport(len(todo), num_tokens, len(wanted) - len(todo), time.perf_counter() - t0)

    def store_keys(self, schema_name: str, module_names: Sequence[str]) -> dict[str, str]:
        """Each named module's store key, as `plan` and `encode` compute it (for callers that drop KV)."""
        return self.schemas.module_keys(schema_name, module_names)

    def ready_to_answer(self, pack: bool = True) -> None:
        """Build the answering forward now, not in the first answer; `pack`: its packed weights too (forward.py)."""
        if (lean := lean_forward(self.model)) is not None and pack:
            lean.pack()

    def is_cached(self, schema_name: str, module_name: str) -> bool:
        return self.store_of(schema_name).contains(self.store_keys(schema_name, [module_name])[module_name])

    # -- the request path: plan → prefill → decode -----------------------------------------------

    def plan(self, prompt: str | ast.Prompt, *, use_cache: bool = True, recovery: str | Recovery | None = None,
             max_new_tokens: int = 0, fallback: bool = True, misses: str | None = None) -> Plan:
        """Compile the prompt and fetch the KV of every module it uses (a miss: `misses`, the constructor's).
        Raises ValueError if the prompt plus `max_new_tokens` does not fit the model's context window.
        `fallback=False`: the cached plan even where this engine's policy would run full prefill."""
        with self.activity.request():
            return self.planner.plan(prompt, use_cache=use_cache, recovery=recovery, max_new_tokens=max_new_tokens,
                                     fallback=fallback, misses=misses)

    def start_prefill(self, plan: Plan, room: int = 0) -> Prefilling:
        """`plan`'s KV assembled with `room` tokens to spare → its new tokens to run, whole or a chunk at a
        time (`Prefilling.run`, under `model_lock`; the batcher's chunked prefill).

        The longest prefix of the plan that an earlier request computed the same way is copied from the
        prefix cache instead (`Prefilling.prefix` says how much); hand the request's cache to
        `keep_kv` when its answer is done, so later requests may reuse this one."""
        if plan.sources is None:  # a full-prefill reference: nothing reused
            todo = start(self.model, plan, self.relocator, self.geometry, room)
            todo.on_ran = self.fallback.ran  # its pace counts too: it is the other path's cost
            return todo
        use = self.prefix_cache.begin(self.prefix_namespace, token_labels(plan.pieces, plan.sources),
                                      plan.pieces, plan.kvs)
        try:
            spliced = dataclasses.replace(plan, pieces=use.pieces, kvs=dict(use.kvs))
            todo = start(self.model, spliced, self.relocator, self.geometry, room)
        finally:  # the reused spans are copied into the request's cache (or assembly failed)
            self.prefix_cache.unlock(use)
        todo.prefix = use
        todo.on_ran = self.fallback.ran
        todo.on_logits = lambda logits: self.prefix_cache.keep_logits(self.prefix_namespace, use, logits)
        return todo

    def prefill(self, plan: Plan, room: int = 0) -> Prefilled:
        """`plan`'s KV assembled with `room` tokens to spare and its new tokens run in one forward → the
        cache (the caller `release`s it when done), the next-token logits and the answer's first
        position; `start_prefill` says what is reused from the prefix cache."""
        todo = self.start_prefill(plan, room)
        with self.activity.request(), self.model_lock:
            first = todo.run(self.model)
        assert first is not None, f"{todo.num_left=}"
        return first

    def keep_kv(self, plan: Plan, prefix: PrefixUse | None, state: DecodeState, keys: Sequence[torch.Tensor],
                values: Sequence[torch.Tensor], length: int) -> int:
        """A finished request's cache, per layer ([H, capacity, D], `length` written): prompt and answer kept in the
        prefix cache (→ tokens newly kept), the plan's by-product entries (`Plan.byproducts`) queued for the store."""
        if prefix is None:
            return 0
        self.planner.keep_byproducts(plan, prefix.pieces, keys, values, length)
        return self.prefix_cache.end(self.prefix_namespace, prefix, keys, values, length, state.tokens, state.start)

    def decode_state(self, plan: Plan, sampling: Sampling, *, t0: float | None = None, lookup: bool = True) -> DecodeState:
        """A fresh `DecodeState` for an answer to `plan`: this engine's tokenizer, EOS ids and prompt
        lookup (`lookup=False`: none, for a cache that cannot be cropped)."""
        grammar = self.grammar(sampling)
        return DecodeState(sampling, start=plan.next_position, eos_ids=self.eos_ids,
                           text=TextStream(self.tokenizer, sampling.stop, sampling.stop_when),
                           history=[t for p in plan.pieces for t in p.token_ids],
                           lookup=self.prompt_lookup if lookup else 0, t0=t0,
                           grammar=grammar.start() if grammar is not None else None)

    def grammar(self, sampling: Sampling) -> Grammar | None:
        """`sampling.response_format` compiled for this tokenizer and EOS ids (cached), or None for free
        text. Raises ValueError for a schema that cannot be used: callers check before queueing."""
        fmt = sampling.response_format
        return None if fmt is None else Grammar.compile(self.tokenizer, fmt, sorted(self.eos_ids))

    def stream_plan(self, plan: Plan, sampling: Sampling, *, t0: float | None = None) -> Stream:
        """Decode an answer to an already made plan (`plan`, possibly altered by the caller)."""
        ticket = self.activity.begin()  # in flight until the answer ends, or the stream is dropped unread
        stream = Stream(self._run(plan, sampling, time.perf_counter() if t0 is None else t0, ticket.end))
        weakref.finalize(stream, ticket.end)
        return stream

    def _run(self, plan: Plan, s: Sampling, t0: float, done: Callable[[], None]) -> Generator[str, None, Result]:
        try:
            return (yield from self._answer(plan, s, t0))
        finally:
            done()

    def _answer(self, plan: Plan, s: Sampling, t0: float) -> Generator[str, None, Result]:
        first = self.prefill(plan, s.max_new_tokens)
        state = self.decode_state(plan, s, t0=t0, lookup=can_crop(first.cache))
        sound = False  # whether the cache holds what the state says (not after a failed forward)
        try:
            yield from state.advance(first.logits[None]).pieces
            yield from decode(self.model, first.cache, state, lock=self.model_lock)
            sound = True
        except GeneratorExit:  # closed by the caller between steps
            sound = True
            raise
        finally:  # finished, stopped or closed by the caller: the KV buffers go back to the pool now
            if sound:
                self.keep_kv(plan, first.prefix, state, *cache_layers(first.cache))
            release(first.cache)
        return plan.result(state, time.perf_counter() - t0, first.prefix.num_tokens if first.prefix else 0,
                           self.adapter_name)

    # -- generation ------------------------------------------------------------------------------

    def generate(
        self, prompt: str | ast.Prompt, *, use_cache: bool = True, recovery: str | Recovery | None = None, **sampling
    ) -> Result:
        """Generate a completion. `use_cache=False` prefills the same token sequence from scratch;
        `recovery` ("none", "first_k:K", "selective:R") overrides the engine's default for this call;
        `misses="encode"` waits for a missed module's own encoding (see the constructor)."""
        return self.stream(prompt, use_cache=use_cache, recovery=recovery, **sampling).consume()

    def stream(
        self, prompt: str | ast.Prompt, *, use_cache: bool = True, recovery: str | Recovery | None = None,
        misses: str | None = None, **sampling
    ) -> Stream:
        s, t0 = Sampling(**sampling), time.perf_counter()
        self.grammar(s)  # raises here, before the first next()
        with self.activity.request():  # from planning on: the stream's own ticket takes over before this ends
            plan = self.plan(prompt, use_cache=use_cache, recovery=recovery, max_new_tokens=s.max_new_tokens, misses=misses)
            return self.stream_plan(plan, s, t0=t0)

    async def agenerate(self, prompt: str | ast.Prompt, **kwargs) -> Result:
        return await asyncio.to_thread(self.generate, prompt, **kwargs)

    def astream(self, prompt: str | ast.Prompt, **kwargs) -> AsyncStream:
        """`async for piece in pc.astream(...)`; `.result` once done. Errors surface on the first step."""
        return AsyncStream(lambda: self.stream(prompt, **kwargs))

    def scheduler(self, *, max_batch: int = 8, max_queue: int = 64,
                  prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, admission: str = DEFAULT_ADMISSION) -> Batcher:
        """A continuous-batching scheduler over this engine (a thread; `close()` it, or use `with`).
        `prefill_chunk`: new prefill tokens run with each decode step (None: each prefill whole);
        `admission`: how whole prefills are admitted between decode steps (batcher.py `ADMISSIONS`)."""
        return Batcher(self, max_batch=max_batch, max_queue=max_queue, prefill_chunk=prefill_chunk,
                       admission=admission)

    def generate_batch(self, prompts: Sequence[str | ast.Prompt], *, max_batch: int = 8, **kwargs) -> list[Result]:
        """Generate for several prompts decoded together (one forward per token for all of them);
        each gets the answer it gets alone. Takes `generate`'s keyword arguments."""
        with self.scheduler(max_batch=max_batch, max_queue=max(len(prompts), 1)) as batcher:
            return batcher.generate(prompts, **kwargs)

    def compare(self, prompt: str | ast.Prompt, *, recovery: str | Recovery | None = None) -> Comparison:
        """Next-token logits of the cached assembly against a full prefill of the same tokens."""
        # the cached assembly is what is compared, alone: nothing from the prefix cache
        plan = dataclasses.replace(self.plan(prompt, recovery=recovery, fallback=False, misses="encode"), sources=None)
        cached, full = self.prefill(plan), self.prefill(uncached(plan))
        for prefilled in (cached, full):
            release(prefilled.cache)
        log_p, log_q = full.logits.log_softmax(-1), cached.logits.log_softmax(-1)
        return Comparison(max_abs_logit_diff=float((full.logits - cached.logits).abs().max()),
                          top1_match=bool(full.logits.argmax() == cached.logits.argmax()),
                          kl=float((log_p.exp() * (log_p - log_q)).sum()), cached_top1=int(cached.logits.argmax()),
                          full_top1=int(full.logits.argmax()), prompt_tokens=plan.num_tokens, cached_tokens=plan.num_cached)

    def full_prefill_ttft(self, prompt: str | ast.Prompt) -> float:
        """Seconds to the first token with nothing cached: the baseline for TTFT comparisons."""
        return self.generate(prompt, use_cache=False, max_new_tokens=1).ttft_s
