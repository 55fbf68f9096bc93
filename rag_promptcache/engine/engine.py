"""`PromptCache`: the engine. PML prompt → plan (hit / miss per module) → assemble → prefill → decode.

A module whose KV is missing from the store (never encoded, evicted, corrupt, or made by another
model: the key is content-addressed, so that is a miss too) is encoded from its text in the request,
used, and written back; the answer is the same as on a hit. On a model with learned absolute
positions a module is reused only where it was encoded; elsewhere its tokens are recomputed in the
prefill, and the result lists it in `recomputed_modules`.

Out of scope here: retrieval (rag/), storage tiers (store/), positions per architecture (model/).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generator

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from rag_promptcache.engine import attention
from rag_promptcache.engine.assemble import assemble, release
from rag_promptcache.engine.compiler import LAYOUTS, ROOT, CompiledSchema, Compiler, Layout, Piece, Unit
from rag_promptcache.engine.decode import DecodeStats, Sampling, TextStream, decode_tokens, eos_token_ids, forward_last
from rag_promptcache.engine.encoder import DEFAULT_MODE, check_mode, encode_units
from rag_promptcache.engine.errors import ContextWindowExceeded
from rag_promptcache.engine.lookup import lookup_tokens
from rag_promptcache.engine.recovery import DEFAULT_RECOVERY, Recovery, recover
from rag_promptcache.engine.result import AsyncStream, Comparison, EncodeReport, FinishReason, Result, Stream
from rag_promptcache.engine.static_decode import bucket, static_decoder, warm_up
from rag_promptcache.model.chat import role_markup
from rag_promptcache.model.loading import load_model, model_fingerprint
from rag_promptcache.model.positions import kv_geometry, relocator_for
from rag_promptcache.pml import ast
from rag_promptcache.pml.parser import parse_prompt, parse_schema, to_pml
from rag_promptcache.store.base import ModuleKV, Store, module_key

if TYPE_CHECKING:
    from rag_promptcache.engine.batcher import Batcher

PLAIN = ""  # the empty schema that plain-text prompts use


@dataclass(frozen=True, slots=True)
class Plan:
    pieces: tuple[Piece, ...]
    kvs: dict[str, ModuleKV]
    hits: tuple[str, ...]
    misses: tuple[str, ...]
    recomputed: tuple[str, ...]
    num_encoded_tokens: int

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

    def result(self, text: str, token_ids: Sequence[int], finish_reason: FinishReason, ttft_s: float,
               total_s: float, num_decode_forwards: int) -> Result:
        """The `Result` of a generation from this plan (the engine's and the batch scheduler's)."""
        return Result(
            text=text,
            token_ids=tuple(token_ids),
            finish_reason=finish_reason,
            ttft_s=ttft_s,
            total_s=total_s,
            prompt_tokens=self.num_tokens,
            cached_tokens=self.num_from_store,
            computed_tokens=self.num_tokens - self.num_cached + self.num_encoded_tokens,
            hit_modules=tuple(n for n in self.hits if n != ROOT),
            missed_modules=tuple(n for n in self.misses if n != ROOT),
            recomputed_modules=tuple(n for n in self.recomputed if n != ROOT),
            num_decode_forwards=num_decode_forwards,
        )


class PromptCache:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        store: Store | None = None,
        mode: str = DEFAULT_MODE,
        layout: Layout = "contiguous",
        name: str | None = None,
        batch_size: int = 8,
        recovery: str | Recovery | None = DEFAULT_RECOVERY,
        codec: str | None = None,
        compile: bool | str | None = None,
        prompt_lookup: int | None = None,
    ) -> None:
        """`compile`: run each decode step through the compiled static step (engine/static_decode.py):
        True or a mode name; None reads RAG_PROMPTCACHE_COMPILE (unset: eager, measured no faster on
        CPU, see the README's limits). Call `warm_decode` before serving to compile ahead of time.

        `prompt_lookup`: greedy answers check up to this many tokens per forward, drafted from the
        prompt and the answer so far (engine/lookup.py); 0 turns it off; None reads
        RAG_PROMPTCACHE_PROMPT_LOOKUP (unset: 8)."""
        prompt_lookup = lookup_tokens(prompt_lookup)
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
        if store is not None and codec is not None:
            # a store holds entries in its own codec; silently ignoring the argument stored native KV
            raise ValueError(
                f"codec={codec!r} applies only to the engine's default MemoryStore, not to a store you pass; "
                f"set it on the store instead, e.g. MemoryStore(codec={codec!r}) or DiskStore(path, codec={codec!r})"
            )
        if store is None:
            from rag_promptcache.store import MemoryStore

            store = MemoryStore(codec=codec or "native")
        self.model = model
        self.tokenizer = tokenizer
        self.store = store
        self.mode = check_mode(mode)
        self.layout = layout
        self.batch_size = batch_size
        self.recovery = Recovery.parse(recovery)
        self.model_name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.fingerprint = model_fingerprint(model)
        self.relocator = relocator_for(model)
        attention.available(model.dtype, model.device)  # builds the CPU kernels now where they run, not in a request
        self.geometry = kv_geometry(model)
        self.context_window = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.compiler = Compiler(tokenizer, role_markup(tokenizer))
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._schemas: dict[str, ast.Schema] = {PLAIN: ast.Schema(PLAIN, ())}
        self._schema_chat: dict[str, bool] = {PLAIN: False}  # whether a schema uses role tags: once, not per request
        self._first_role: dict[str, str | None] = {PLAIN: None}  # its first role tag, in document order
        self._compiled: dict[tuple[str, bool, bool], CompiledSchema] = {}
        self._keys: dict[tuple[str, bool, bool, str], str] = {}
        self._lock = threading.Lock()  # the schema, compiled-schema and key maps
        # Every forward pass of this model runs under it: prefill, each decode step, encoding, recovery
        # passes (whose layer hooks would otherwise fire in another thread's forward). Reentrant, so a
        # caller (the batch scheduler) may hold it around engine calls.
        self.model_lock = threading.RLock()
        self.decoder = static_decoder(model, compile)  # None: every decode step runs eagerly
        self.prompt_lookup = prompt_lookup

    @classmethod
    def from_pretrained(
        cls,
        model: str = "smollm2-135m-instruct",
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        **kwargs,
    ) -> PromptCache:
        """`dtype`: a torch dtype, or "auto" (None), "float32", "bfloat16", "float16"."""
        hf_model, tokenizer = load_model(model, device=device, dtype=dtype)
        return cls(hf_model, tokenizer, name=kwargs.pop("name", model), **kwargs)

    def warm_decode(self, num_tokens: int) -> float:
        """Compile the decode step for requests of up to `num_tokens` (prompt and answer) now, rather
        than in the first such request → seconds it took (0.0 when compiling is off or already done)."""
        if self.decoder is None:
            return 0.0
        with self.model_lock:
            return warm_up(self.decoder, self.model, num_tokens)

    # -- schemas ---------------------------------------------------------------------------------

    def add_schema(self, schema: str | ast.Schema, *, replace: bool = False) -> ast.Schema:
        """Register a schema, given as PML or as a parsed `Schema`. Registering the same content
        again is a no-op; a name already registered to other content needs `replace=True`."""
        parsed = parse_schema(schema) if isinstance(schema, str) else schema
        if not parsed.name:
            raise ValueError("a schema needs a non-empty name (the empty name is the engine's plain-prompt schema)")
        with self._lock:
            old = self._schemas.get(parsed.name)
            if old is not None and _same_schema(old, parsed):
                return old
            if old is not None and not replace:
                raise ValueError(f"schema {parsed.name!r} is already registered with other content; "
                                 "pass replace=True to replace it, or register it under another name")
            self._schemas[parsed.name] = parsed
            self._schema_chat[parsed.name] = _uses_roles(parsed.children)
            self._first_role[parsed.name] = _first_role(parsed.children)
            self._compiled = {k: v for k, v in self._compiled.items() if k[0] != parsed.name}
            self._keys = {k: v for k, v in self._keys.items() if k[0] != parsed.name}
        return parsed

    def schema(self, name: str) -> ast.Schema:
        if name not in self._schemas:
            known = ", ".join(repr(n) for n in sorted(self._schemas) if n != PLAIN) or "none"
            raise ValueError(f"unknown schema {name!r}; known: {known}")
        return self._schemas[name]

    def encode(
        self,
        schema_name: str,
        module_names: Sequence[str] | None = None,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> EncodeReport:
        """Compute and store the KV of the schema's modules (all, or the named ones) not stored yet.

        The schema's anonymous text (its root) is included when encoding all. `progress(n)` is called
        after each batch with the number of modules it encoded.
        """
        t0 = time.perf_counter()
        chat, default = self._chat_of(schema_name, ())
        compiled = self._compile(schema_name, chat, default)
        names = list(compiled.units) if module_names is None else list(module_names)
        for n in names:
            if n not in compiled.units:
                raise ValueError(f"schema {schema_name!r} has no module {n!r}")
        wanted = [compiled.units[n] for n in names if compiled.units[n].token_ids]
        todo = [u for u in wanted if not self.store.contains(self._key(compiled, u, chat, default))]
        num_tokens = 0
        for b in range(0, len(todo), self.batch_size):
            batch = todo[b : b + self.batch_size]
            with self.model_lock:
                kvs = encode_units(self.model, batch, mode=self.mode, fingerprint=self.fingerprint,
                                   batch_size=self.batch_size)
            for u, kv in zip(batch, kvs):
                self.store.put(self._key(compiled, u, chat, default), kv)
                num_tokens += kv.num_tokens
            if progress is not None:
                progress(len(batch))
        return EncodeReport(len(todo), num_tokens, len(wanted) - len(todo), time.perf_counter() - t0)

    # -- generation ------------------------------------------------------------------------------

    def generate(
        self, prompt: str | ast.Prompt, *, use_cache: bool = True, recovery: str | Recovery | None = None, **sampling
    ) -> Result:
        """Generate a completion. `use_cache=False` prefills the same token sequence from scratch;
        `recovery` ("none", "first_k:K", "selective:R") overrides the engine's default for this call."""
        return self.stream(prompt, use_cache=use_cache, recovery=recovery, **sampling).consume()

    def stream(
        self, prompt: str | ast.Prompt, *, use_cache: bool = True, recovery: str | Recovery | None = None, **sampling
    ) -> Stream:
        s = Sampling(**sampling)
        t0 = time.perf_counter()
        # raises here, before the first next()
        plan = self.plan(prompt, use_cache=use_cache, recovery=recovery, max_new_tokens=s.max_new_tokens)
        return Stream(self._run(plan, s, t0))

    async def agenerate(self, prompt: str | ast.Prompt, **kwargs) -> Result:
        return await asyncio.to_thread(self.generate, prompt, **kwargs)

    def astream(self, prompt: str | ast.Prompt, **kwargs) -> AsyncStream:
        """`async for piece in pc.astream(...)`; `.result` once done. Errors surface on the first step."""
        return AsyncStream(lambda: self.stream(prompt, **kwargs))

    def scheduler(self, *, max_batch: int = 8, max_queue: int = 64) -> Batcher:
        """A continuous-batching scheduler over this engine (a thread; `close()` it, or use `with`)."""
        from rag_promptcache.engine.batcher import Batcher

        return Batcher(self, max_batch=max_batch, max_queue=max_queue)

    def generate_batch(self, prompts: Sequence[str | ast.Prompt], *, max_batch: int = 8, **kwargs) -> list[Result]:
        """Generate for several prompts decoded together (one forward per token for all of them);
        each gets the answer it gets alone. Takes `generate`'s keyword arguments."""
        with self.scheduler(max_batch=max_batch, max_queue=max(len(prompts), 1)) as batcher:
            return batcher.generate(prompts, **kwargs)

    def compare(self, prompt: str | ast.Prompt, *, recovery: str | Recovery | None = None) -> Comparison:
        """Next-token logits of the cached assembly against a full prefill of the same tokens."""
        plan = self.plan(prompt, recovery=recovery)
        cached = self._prefill(plan, 0)[1]
        full = self._prefill(_uncached(plan), 0)[1]
        log_p, log_q = full.log_softmax(-1), cached.log_softmax(-1)
        return Comparison(
            max_abs_logit_diff=float((full - cached).abs().max()),
            top1_match=bool(full.argmax() == cached.argmax()),
            kl=float((log_p.exp() * (log_p - log_q)).sum()),
            cached_top1=int(cached.argmax()),
            full_top1=int(full.argmax()),
            prompt_tokens=plan.num_tokens,
            cached_tokens=plan.num_cached,
        )

    def full_prefill_ttft(self, prompt: str | ast.Prompt) -> float:
        """Seconds to the first token with nothing cached: the baseline for TTFT comparisons."""
        return self.generate(prompt, use_cache=False, max_new_tokens=1).ttft_s

    def store_keys(self, schema_name: str, module_names: Sequence[str]) -> dict[str, str]:
        """The store key of each named module's KV, as `plan` and `encode` compute it: callers that drop
        KV (a corpus removing a document) ask here rather than copy the formula."""
        chat, default = self._chat_of(schema_name, ())
        compiled = self._compile(schema_name, chat, default)
        return {m: self._key(compiled, compiled.units[m], chat, default) for m in module_names}

    def is_cached(self, schema_name: str, module_name: str) -> bool:
        chat, default = self._chat_of(schema_name, ())
        compiled = self._compile(schema_name, chat, default)
        return self.store.contains(self._key(compiled, compiled.units[module_name], chat, default))

    # -- internals -------------------------------------------------------------------------------

    def plan(
        self,
        prompt: str | ast.Prompt,
        *,
        use_cache: bool = True,
        recovery: str | Recovery | None = None,
        max_new_tokens: int = 0,
    ) -> Plan:
        """Compile the prompt and fetch (or encode and store) the KV of every module it uses.
        Raises ValueError if the prompt plus `max_new_tokens` does not fit the model's context window."""
        parsed = self._parse(prompt)
        chat, default = self._chat_of(parsed.schema, parsed.children)
        compiled = self._compile(parsed.schema, chat, default)
        pieces = self.compiler.compile_prompt(compiled, parsed, self.layout)
        if not pieces or not any(p.token_ids for p in pieces):
            raise ValueError("empty prompt: it compiles to no tokens")
        self._check_window(pieces, max_new_tokens)
        if not use_cache:
            return _uncached(Plan(tuple(pieces), {}, (), (), (), 0))
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
        kvs: dict[str, ModuleKV] = {}
        misses: list[Unit] = []
        for name in needed:
            unit = compiled.units[name]
            kv = self.store.get(self._key(compiled, unit, chat, default))
            # keys are content addresses; this re-checks what the entry says of itself, so a foreign
            # entry planted under our key is recomputed, never used
            if kv is None or (kv.token_ids, kv.fingerprint, kv.mode) != (unit.token_ids, self.fingerprint, self.mode):
                misses.append(unit)
            else:
                kvs[name] = kv
        encoded = 0
        if misses:
            with self.model_lock:
                encoded_kvs = encode_units(self.model, misses, mode=self.mode, fingerprint=self.fingerprint,
                                           batch_size=self.batch_size)
            for u, kv in zip(misses, encoded_kvs):
                self.store.put(self._key(compiled, u, chat, default), kv)
                kvs[u.name] = kv
                encoded += kv.num_tokens
        chosen = self.recovery if recovery is None else Recovery.parse(recovery)
        with self.model_lock:
            pieces = recover(chosen, pieces, kvs, self.model, self.relocator, self.geometry)
        return Plan(tuple(pieces), kvs, tuple(n for n in needed if n not in {u.name for u in misses}),
                    tuple(u.name for u in misses), tuple(dict.fromkeys(recomputed)), encoded)

    @torch.inference_mode()
    def _prefill(self, plan: Plan, max_new_tokens: int, static: bool = False) -> tuple[DynamicCache, torch.Tensor, int]:
        """→ (cache with room for the answer, next-token logits [V] fp32, next position). `static`: reserve
        a capacity bucket, the shape the compiled decode step has a graph for."""
        extra = max_new_tokens
        if static and self.decoder is not None:
            extra = bucket(plan.num_tokens + max_new_tokens) - plan.num_tokens
        asm = assemble(plan.pieces, plan.kvs, self.relocator, self.model.config, self.geometry,
                       self.model.device, self.model.dtype, extra=extra)
        with self.model_lock:
            logits = forward_last(self.model, asm.new_ids, asm.new_positions, asm.cache, asm.mask)
        next_position = max(p.position + len(p.token_ids) for p in plan.pieces)
        return asm.cache, logits, next_position

    def _run(self, plan: Plan, s: Sampling, t0: float) -> Generator[str, None, Result]:
        cache, logits, next_position = self._prefill(plan, s.max_new_tokens, static=True)
        step = None
        if self.decoder is not None and self.decoder.fits(cache):
            step = functools.partial(self.decoder.step, cache=cache)
        text = TextStream(self.tokenizer, s.stop)
        ids: list[int] = []
        ttft = 0.0
        finish = "length"
        stats = DecodeStats()
        steps = decode_tokens(self.model, cache, logits, next_position, s,
                              frozenset() if s.ignore_eos else self.eos_ids, step,
                              history=[t for p in plan.pieces for t in p.token_ids], lookup=self.prompt_lookup,
                              stats=stats)
        try:
            while True:
                with self.model_lock:  # one decode step; never held across a yield to the caller
                    token = next(steps, None)
                if token is None:
                    break
                if not ids:
                    ttft = time.perf_counter() - t0
                ids.append(token)
                if token in self.eos_ids and not s.ignore_eos:
                    finish = "eos"
                    break
                piece = text.push(token)
                if piece:
                    yield piece
                if text.stopped:
                    finish = "stop"
                    break
        finally:  # finished, stopped or closed by the caller: the KV buffers go back to the pool now
            steps.close()
            release(cache)
        tail = text.finish()
        if tail:
            yield tail
        return plan.result(text.text, ids, finish, ttft, time.perf_counter() - t0, stats.num_forwards)

    def _check_window(self, pieces: Sequence[Piece], max_new_tokens: int) -> None:
        # positions, not token counts: the schema layout leaves gaps, and RoPE tables end at the window
        end = max(p.position + len(p.token_ids) for p in pieces)
        if end + max_new_tokens > self.context_window:
            num_tokens = sum(len(p.token_ids) for p in pieces)
            where = "" if end == num_tokens else f" reaching position {end}"
            raise ContextWindowExceeded(
                f"prompt of {num_tokens} tokens{where} plus max_new_tokens={max_new_tokens} is "
                f"{end + max_new_tokens}, past the model's {self.context_window}-token context window; "
                "shorten the prompt (fewer or smaller modules) or lower max_new_tokens"
            )

    def _parse(self, prompt: str | ast.Prompt) -> ast.Prompt:
        if isinstance(prompt, ast.Prompt):
            return prompt
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is PML or plain text (str), got {type(prompt).__name__}")
        if prompt.lstrip().startswith("<prompt"):
            return parse_prompt(prompt, self._schemas)
        return ast.Prompt(PLAIN, (ast.Text(prompt),))

    def _chat_of(self, name: str, prompt_children: Sequence[ast.PromptNode]) -> tuple[bool, bool]:
        """(whether the sequence is a conversation, whether the template's default system turn opens
        it: its first role, the schema's or else the prompt's, is not a system message)."""
        schema = self.schema(name).name
        chat = self._schema_chat[schema] or _uses_roles(prompt_children)
        first = self._first_role[schema] or _first_role(prompt_children)
        return chat, chat and bool(self.compiler.markup.default_system) and first != "system"

    def _compile(self, name: str, chat: bool, default_system: bool = False) -> CompiledSchema:
        with self._lock:
            compiled = self._compiled.get((name, chat, default_system))
            if compiled is None:
                compiled = self.compiler.compile_schema(self.schema(name), chat, default_system)
                self._compiled[(name, chat, default_system)] = compiled
            return compiled

    def _key(self, compiled: CompiledSchema, unit: Unit, chat: bool, default_system: bool = False) -> str:
        memo = (compiled.name, chat, default_system, unit.name)
        with self._lock:
            key = self._keys.get(memo)
        if key is None:
            context = unit.context_ids if self.mode == "shared_prefix" else ()
            key = module_key(self.fingerprint, self.mode, unit.token_ids, unit.encode_start, context)
            with self._lock:  # memoised only for the current compilation: a schema may be replaced meanwhile
                if self._compiled.get((compiled.name, chat, default_system)) is compiled:
                    self._keys[memo] = key
        return key


def _uncached(plan: Plan) -> Plan:
    """The same token sequence with every piece computed: the full-prefill reference."""
    merged = Piece(tuple(t for p in plan.pieces for t in p.token_ids), plan.pieces[0].position)
    contiguous = all(
        b.position == a.position + len(a.token_ids) for a, b in zip(plan.pieces, plan.pieces[1:])
    )
    pieces = (merged,) if contiguous else tuple(Piece(p.token_ids, p.position) for p in plan.pieces if p.token_ids)
    return Plan(pieces, {}, (), (), (), 0)


def _same_schema(a: ast.Schema, b: ast.Schema) -> bool:
    """The same content, wherever it was written: positions in the PML source do not count."""
    return to_pml(a) == to_pml(b)


def _first_role(nodes: Iterable[object]) -> str | None:
    for n in nodes:
        if isinstance(n, ast.Role):
            return n.role
        children = getattr(n, "children", None) or getattr(n, "modules", None)
        if children and (role := _first_role(children)) is not None:
            return role
    return None


def _uses_roles(nodes: Iterable[object]) -> bool:
    for n in nodes:
        if isinstance(n, ast.Role):
            return True
        children = getattr(n, "children", None) or getattr(n, "modules", None)
        if children and _uses_roles(children):
            return True
    return False
