"""Prefill, sampling and the decode loop, gpt-fast style: small functions over a HF model and its cache.

Also `TextStream`, which turns token ids into text pieces while holding back what could still become
a stop string or is an incomplete UTF-8 sequence. Nothing here knows about modules or stores.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from rag_promptcache.engine.assemble import ReservedLayer
from rag_promptcache.engine.forward import LeanLlama
from rag_promptcache.engine.lookup import NgramDrafter


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling options. `stop` takes one string or a sequence of strings (as OpenAI, LangChain and
    LlamaIndex do) and is held as a tuple: a bare string is one stop string, never its characters."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Both look at the answer's own tokens only, never the prompt's: a RAG answer should copy its sources.
    repetition_penalty: float = 1.0  # > 1 divides a positive logit (multiplies a negative one) of each token already generated
    no_repeat_ngram: int = 0  # n > 0: no n-gram of the answer is generated twice (stops verbatim loops)
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks), as vLLM's ignore_eos

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) for s in stop):
            raise ValueError(f"stop takes a string or a sequence of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)  # normalised once here: every caller gets a tuple
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.repetition_penalty < 1.0:
            raise ValueError(f"repetition_penalty must be >= 1.0 (1.0 is off), got {self.repetition_penalty}")
        if self.no_repeat_ngram < 0 or self.no_repeat_ngram == 1:
            raise ValueError(f"no_repeat_ngram must be 0 (off) or >= 2, got {self.no_repeat_ngram}")


_FORCE_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


class _Switch:
    """The environment switch is process-global: count the forward passes that need it, so that one
    thread leaving never unsets it under another thread's forward (of this engine or another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._set_outside = False  # the user set it: never unset it

    def enter(self) -> None:
        with self._lock:
            if self._users == 0:
                self._set_outside = os.environ.get(_FORCE_GQA) is not None
                if not self._set_outside:
                    os.environ[_FORCE_GQA] = "1"
            self._users += 1

    def exit(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and not self._set_outside:
                os.environ.pop(_FORCE_GQA, None)


_GQA = _Switch()


@contextmanager
def native_gqa(device: torch.device) -> Iterator[None]:
    """On CPU, let SDPA do grouped-query attention itself, masks included.

    For a masked prefill (new tokens against a cache: q < kv) transformers otherwise repeats the KV
    heads, copying the whole cache in every layer: at 2k context on SmolLM2 that was a third of the
    time to first token. transformers reads this switch on every call; we set it only around our own
    forward passes and only on CPU (on CUDA a mask with GQA would fall back to the slow math kernel).
    """
    if device.type != "cpu":
        yield
        return
    _GQA.enter()
    try:
        yield
    finally:
        _GQA.exit()


_LEAN: weakref.WeakKeyDictionary[PreTrainedModel, LeanLlama | None] = weakref.WeakKeyDictionary()


def lean_forward(model: PreTrainedModel) -> LeanLlama | None:
    """The model's lean forward (engine/forward.py), built once per model; None where it has none."""
    if model not in _LEAN:
        _LEAN[model] = LeanLlama.for_model(model)
    return _LEAN[model]


@torch.inference_mode()  # per call: a stream may resume on another thread, and the mode is thread-local
def forward_logits(
    model: PreTrainedModel,
    ids: torch.Tensor,
    positions: torch.Tensor,
    cache: DynamicCache,
    mask: torch.Tensor | None = None,
    *,
    keep: int = 1,
    lean: bool = True,
) -> torch.Tensor:
    """Run `ids` [1, N] at `positions` [1, N] against `cache`; return the last `keep` tokens' logits [keep, V] in fp32.

    `lean`: use the lean forward where the model and cache allow it (`lean=False`: transformers')."""
    fast = lean_forward(model) if lean else None
    if fast is not None and all(type(layer) is ReservedLayer for layer in cache.layers):
        return fast(ids, positions, cache, mask, keep=keep)
    with native_gqa(ids.device):
        out = model(input_ids=ids, position_ids=positions, past_key_values=cache, attention_mask=mask,
                    use_cache=True, logits_to_keep=keep)
    return out.logits[0, -keep:].float()


def forward_last(model: PreTrainedModel, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache,
                 mask: torch.Tensor | None = None, *, lean: bool = True) -> torch.Tensor:
    """`forward_logits` of the last token only → logits [V] fp32."""
    return forward_logits(model, ids, positions, cache, mask, lean=lean)[-1]


def penalize(logits: torch.Tensor, s: Sampling, generated: Sequence[int]) -> torch.Tensor:
    """logits: [V] fp32 → the same with the repetition controls applied to the answer so far."""
    if s.repetition_penalty != 1.0 and generated:
        seen = torch.tensor(sorted(set(generated)), device=logits.device)
        values = logits[seen]
        logits = logits.index_put((seen,), torch.where(values > 0, values / s.repetition_penalty, values * s.repetition_penalty))
    n = s.no_repeat_ngram
    if n and len(generated) >= n:
        prefix = tuple(generated[len(generated) - n + 1 :])
        banned = {generated[i + n - 1] for i in range(len(generated) - n + 1) if tuple(generated[i : i + n - 1]) == prefix}
        if banned:
            logits = logits.index_fill(0, torch.tensor(sorted(banned), device=logits.device), float("-inf"))
    return logits


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None, generated: Sequence[int] = ()) -> int:
    """logits: [V] fp32 → one token id. `generated`: the answer's tokens so far (for the repetition controls)."""
    logits = penalize(logits, s, generated)
    if s.temperature == 0:
        return int(logits.argmax())
    logits = logits / s.temperature
    if s.top_k:
        kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) > s.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(slots=True)
class DecodeStats:
    """What one answer's decode loop ran: forwards after the prefill, and the prompt lookup drafts."""

    num_forwards: int = 0
    num_drafted: int = 0
    num_accepted: int = 0  # drafted tokens that were the model's own pick: each saved a forward


def decode_tokens(
    model: PreTrainedModel,
    cache: DynamicCache,
    logits: torch.Tensor,
    next_position: int,
    s: Sampling,
    eos_ids: frozenset[int],
    step: Callable[[int, int], torch.Tensor] | None = None,
    *,
    history: Sequence[int] = (),
    lookup: int = 0,
    stats: DecodeStats | None = None,
) -> Iterator[int]:
    """Yield up to max_new_tokens ids; an EOS id is yielded and ends the loop. The caller may stop early.

    `step(token, position) -> logits [V]` runs one token into `cache` (the compiled static step,
    engine/static_decode.py); None: `forward_logits`, eagerly. `lookup` > 0 (greedy, eager, a cache
    that can be cropped): each forward also checks up to `lookup` tokens drafted from `history` (the
    prompt's ids) and the answer so far (engine/lookup.py); a draft token is kept while it is the
    token the model picks after the ones before it, so the answer is greedy decoding's. `stats`, if
    given, counts the forwards and the drafted and accepted tokens."""
    device = model.device
    generator = None
    if s.seed is not None and s.temperature > 0:
        generator = torch.Generator(device=logits.device).manual_seed(s.seed)
    speculate = lookup > 0 and s.temperature == 0 and step is None and can_crop(cache)
    drafter: NgramDrafter | None = None
    generated: list[int] = []
    rows, draft = logits[None], []  # rows: [1 + len(draft), V], row j the logits after draft[:j]
    while True:
        accepted = 0
        for token, kept in verify(rows, draft, s, generator, generated):
            generated.append(token)
            accepted += kept
            if stats is not None:
                stats.num_accepted += kept
            yield token
            if token in eos_ids or len(generated) == s.max_new_tokens:
                return
        if accepted < len(draft):  # the rest of the draft was rejected: drop its KV
            cache.crop(accepted - len(draft))
        position = next_position + len(generated) - 1
        if speculate:
            drafter = drafter or NgramDrafter(history)  # built after the first token, not before it
            draft = drafter.draft_after(generated, min(lookup, s.max_new_tokens - len(generated) - 1))
        if stats is not None:
            stats.num_forwards += 1
            stats.num_drafted += len(draft)
        if step is not None:
            rows = step(token, position)[None]
            continue
        ids = torch.tensor([[token, *draft]], device=device)
        positions = torch.arange(position, position + ids.shape[1], device=device)[None]
        rows = forward_logits(model, ids, positions, cache, keep=ids.shape[1])


def verify(rows: torch.Tensor, draft: Sequence[int], s: Sampling, generator: torch.Generator | None,
           generated: Sequence[int]) -> Iterator[tuple[int, bool]]:
    """Check a draft: rows [1 + len(draft), V], row j the logits after draft[:j] → (token, whether it
    is draft[j]) per row, up to the first token that is not. The caller appends each token to
    `generated` (the answer so far, for the repetition controls) before asking for the next."""
    for j in range(rows.shape[0]):
        token = sample(rows[j], s, generator, generated)
        kept = j < len(draft) and token == draft[j]
        yield token, kept
        if not kept:
            return


def can_crop(cache: DynamicCache) -> bool:
    """Whether dropping a cache's last tokens restores it exactly (not so for sliding windows)."""
    return all(type(layer) in (DynamicLayer, ReservedLayer) for layer in cache.layers)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


class TextStream:
    """Token ids in, text pieces out; stops at the first stop string, which is not emitted."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # text emitted so far
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if full.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        return self._emit(full, final=False)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True), final=True)

    def _emit(self, full: str, final: bool) -> str:
        cut = min((i for i in (full.find(s, max(0, len(self.text) - len(s))) for s in self.stop) if i >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            piece, self.text = full[len(self.text) : cut], full[:cut]
            return piece
        safe = len(full)
        if not final:
            for s in self.stop:  # hold back a tail that could still grow into a stop string
                for k in range(min(len(s) - 1, len(full)), 0, -1):
                    if full.endswith(s[:k]):
                        safe = min(safe, len(full) - k)
                        break
        safe = max(safe, len(self.text))
        piece, self.text = full[len(self.text) : safe], full[:safe]
        return piece
