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
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generator

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from rag_promptcache.engine.assemble import assemble
from rag_promptcache.engine.compiler import LAYOUTS, ROOT, CompiledSchema, Compiler, Layout, Piece, Unit
from rag_promptcache.engine.decode import Sampling, TextStream, decode_tokens, eos_token_ids, forward_last
from rag_promptcache.engine.encoder import DEFAULT_MODE, check_mode, encode_units
from rag_promptcache.engine.recovery import DEFAULT_RECOVERY, Recovery, recover
from rag_promptcache.engine.result import AsyncStream, Comparison, EncodeReport, Result, Stream
from rag_promptcache.model.chat import role_markup
from rag_promptcache.model.loading import load_model, model_fingerprint
from rag_promptcache.model.positions import kv_geometry, relocator_for
from rag_promptcache.pml import ast
from rag_promptcache.pml.parser import parse_prompt, parse_schema
from rag_promptcache.store.base import ModuleKV, Store, module_key

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
        return sum(len(p.token_ids) for p in self.pieces if p.cached)


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
        codec: str = "native",
    ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
        if store is None:
            from rag_promptcache.store import MemoryStore

            store = MemoryStore(codec=codec)
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
        self.geometry = kv_geometry(model)
        self.context_window = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
        self.compiler = Compiler(tokenizer, role_markup(tokenizer))
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._schemas: dict[str, ast.Schema] = {PLAIN: ast.Schema(PLAIN, ())}
        self._schema_chat: dict[str, bool] = {PLAIN: False}  # whether a schema uses role tags: once, not per request
        self._compiled: dict[tuple[str, bool], CompiledSchema] = {}
        self._keys: dict[tuple[str, bool, str], str] = {}
        self._lock = threading.Lock()

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

    # -- schemas ---------------------------------------------------------------------------------

    def add_schema(self, schema: str | ast.Schema) -> ast.Schema:
        """Register (or replace) a schema, given as PML or as a parsed `Schema`."""
        parsed = parse_schema(schema) if isinstance(schema, str) else schema
        with self._lock:
            self._schemas[parsed.name] = parsed
            self._schema_chat[parsed.name] = _uses_roles(parsed.children)
            for chat in (False, True):
                self._compiled.pop((parsed.name, chat), None)
            self._keys = {k: v for k, v in self._keys.items() if k[0] != parsed.name}
        return parsed

    def schema(self, name: str) -> ast.Schema:
        if name not in self._schemas:
            raise ValueError(f"unknown schema {name!r}; known: {', '.join(sorted(self._schemas)) or 'none'}")
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
        chat = self._schema_chat[self.schema(schema_name).name]
        compiled = self._compile(schema_name, chat)
        names = list(compiled.units) if module_names is None else list(module_names)
        for n in names:
            if n not in compiled.units:
                raise ValueError(f"schema {schema_name!r} has no module {n!r}")
        wanted = [compiled.units[n] for n in names if compiled.units[n].token_ids]
        todo = [u for u in wanted if not self.store.contains(self._key(compiled, u, chat))]
        num_tokens = 0
        for b in range(0, len(todo), self.batch_size):
            batch = todo[b : b + self.batch_size]
            for u, kv in zip(batch, encode_units(self.model, batch, mode=self.mode, fingerprint=self.fingerprint,
                                                 batch_size=self.batch_size)):
                self.store.put(self._key(compiled, u, chat), kv)
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
        s = Sampling(**{k: tuple(v) if k == "stop" else v for k, v in sampling.items()})
        t0 = time.perf_counter()
        plan = self.plan(prompt, use_cache=use_cache, recovery=recovery)  # raises here, before the first next()
        return Stream(self._run(plan, s, t0))

    async def agenerate(self, prompt: str | ast.Prompt, **kwargs) -> Result:
        return await asyncio.to_thread(self.generate, prompt, **kwargs)

    def astream(self, prompt: str | ast.Prompt, **kwargs) -> AsyncStream:
        """`async for piece in pc.astream(...)`; `.result` once done. Errors surface on the first step."""
        return AsyncStream(lambda: self.stream(prompt, **kwargs))

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

    def is_cached(self, schema_name: str, module_name: str) -> bool:
        chat = self._schema_chat[self.schema(schema_name).name]
        compiled = self._compile(schema_name, chat)
        return self.store.contains(self._key(compiled, compiled.units[module_name], chat))

    # -- internals -------------------------------------------------------------------------------

    def plan(
        self, prompt: str | ast.Prompt, *, use_cache: bool = True, recovery: str | Recovery | None = None
    ) -> Plan:
        """Compile the prompt and fetch (or encode and store) the KV of every module it uses."""
        parsed = self._parse(prompt)
        chat = self._schema_chat[self.schema(parsed.schema).name] or _uses_roles(parsed.children)
        compiled = self._compile(parsed.schema, chat)
        pieces = self.compiler.compile_prompt(compiled, parsed, self.layout)
        if not pieces or not any(p.token_ids for p in pieces):
            raise ValueError("empty prompt: it compiles to no tokens")
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
            kv = self.store.get(self._key(compiled, unit, chat))
            # keys are content addresses; this re-checks what the entry says of itself, so a foreign
            # entry planted under our key is recomputed, never used
            if kv is None or (kv.token_ids, kv.fingerprint, kv.mode) != (unit.token_ids, self.fingerprint, self.mode):
                misses.append(unit)
            else:
                kvs[name] = kv
        encoded = 0
        if misses:
            for u, kv in zip(misses, encode_units(self.model, misses, mode=self.mode, fingerprint=self.fingerprint,
                                                  batch_size=self.batch_size)):
                self.store.put(self._key(compiled, u, chat), kv)
                kvs[u.name] = kv
                encoded += kv.num_tokens
        chosen = self.recovery if recovery is None else Recovery.parse(recovery)
        pieces = recover(chosen, pieces, kvs, self.model, self.relocator, self.geometry)
        return Plan(tuple(pieces), kvs, tuple(n for n in needed if n not in {u.name for u in misses}),
                    tuple(u.name for u in misses), tuple(dict.fromkeys(recomputed)), encoded)

    @torch.inference_mode()
    def _prefill(self, plan: Plan, max_new_tokens: int) -> tuple[DynamicCache, torch.Tensor, int]:
        """→ (cache with room for the answer, next-token logits [V] fp32, next position)."""
        asm = assemble(plan.pieces, plan.kvs, self.relocator, self.model.config, self.geometry,
                       self.model.device, self.model.dtype, extra=max_new_tokens)
        logits = forward_last(self.model, asm.new_ids, asm.new_positions, asm.cache, asm.mask)
        next_position = max(p.position + len(p.token_ids) for p in plan.pieces)
        return asm.cache, logits, next_position

    def _run(self, plan: Plan, s: Sampling, t0: float) -> Generator[str, None, Result]:
        cache, logits, next_position = self._prefill(plan, s.max_new_tokens)
        text = TextStream(self.tokenizer, s.stop)
        ids: list[int] = []
        ttft = 0.0
        finish = "length"
        for token in decode_tokens(self.model, cache, logits, next_position, s, frozenset() if s.ignore_eos else self.eos_ids):
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
        tail = text.finish()
        if tail:
            yield tail
        return Result(
            text=text.text,
            token_ids=tuple(ids),
            finish_reason=finish,
            ttft_s=ttft,
            total_s=time.perf_counter() - t0,
            prompt_tokens=plan.num_tokens,
            cached_tokens=plan.num_cached,
            computed_tokens=plan.num_tokens - plan.num_cached + plan.num_encoded_tokens,
            hit_modules=tuple(n for n in plan.hits if n != ROOT),
            missed_modules=tuple(n for n in plan.misses if n != ROOT),
            recomputed_modules=tuple(n for n in plan.recomputed if n != ROOT),
        )

    def _parse(self, prompt: str | ast.Prompt) -> ast.Prompt:
        if isinstance(prompt, ast.Prompt):
            return prompt
        if not isinstance(prompt, str):
            raise ValueError(f"a prompt is PML or plain text (str), got {type(prompt).__name__}")
        if prompt.lstrip().startswith("<prompt"):
            return parse_prompt(prompt, self._schemas)
        return ast.Prompt(PLAIN, (ast.Text(prompt),))

    def _compile(self, name: str, chat: bool) -> CompiledSchema:
        with self._lock:
            compiled = self._compiled.get((name, chat))
            if compiled is None:
                compiled = self.compiler.compile_schema(self.schema(name), chat)
                self._compiled[(name, chat)] = compiled
            return compiled

    def _key(self, compiled: CompiledSchema, unit: Unit, chat: bool) -> str:
        memo = (compiled.name, chat, unit.name)
        key = self._keys.get(memo)
        if key is None:
            context = unit.context_ids if self.mode == "shared_prefix" else ()
            key = module_key(self.fingerprint, self.mode, unit.token_ids, unit.encode_start, context)
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


def _uses_roles(nodes: Iterable[object]) -> bool:
    for n in nodes:
        if isinstance(n, ast.Role):
            return True
        children = getattr(n, "children", None) or getattr(n, "modules", None)
        if children and _uses_roles(children):
            return True
    return False
