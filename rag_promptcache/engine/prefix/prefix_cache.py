"""Earlier requests' KV, reused exactly: the engine's side of the prefix tree (engine/prefix/prefix_tree.py).

A follow-up chat turn repeats its previous turn's prompt and answer, then adds a question. This keeps
the KV each request ended with, per token, and hands the longest prefix of a new request that an
earlier one computed *the same way* back to its prefill, so only the rest is assembled and computed.

What "exact" means here (the rule the tests check): a request with the prefix cache on computes the
same KV, token for token, as the same request with it off, under the same plan. The plan is made
first, as if the cache were off: the prompt's pieces, which modules come from stored KV, which tokens
recovery recomputes (`last:N` recomputes the modules nearest the question, and in a follow-up turn
those may be other modules than in the turn before). Then each token gets a label saying how the plan
produces its KV:

- a token computed in the request (new text, or a module token that recovery recomputes):
  `(token id, position)`. Its KV is a function of every label up to and including its own, since it
  attends causally to all of them;
- a token assembled from a module's stored KV: `(token id, position, store key, offset in the
  module)`. Its KV is that stored entry's, moved to `position`: nothing before it matters.

So two requests whose labels agree on tokens 0..i have equal KV for tokens 0..i, and the longest
common prefix of labels is what may be reused. Token ids alone are not enough: turn 1 with recovery
`last:2` over modules A B C D computes C and D against A and B, while turn 2 retrieving A B C D E
assembles C from the store; reusing turn 1's C there would change turn 2's answer (for the better,
perhaps, but it would not be the answer of the plan). The namespace (model fingerprint, dtype, device,
encoding mode) keeps models apart. Answers are stored too, as computed tokens, up to the last one fed
to the model (the last sampled token, often EOS, has no KV).

A request whose labels the cache holds whole, from an earlier request's prompt, is a repeat: the
prompt's last token's logits are kept with its KV (`keep_logits`, when a prefill finishes), so a repeat
runs no forward at all and starts decoding from the same numbers the first request did (bf16 too).
The logits sit beside the tree, in a small LRU of their own (`MAX_LOGITS` prompts), and count only
where the tree still holds the whole prompt.

Equal here is equal in exact arithmetic: the reused KV was computed in another forward (another
number of new tokens, one decode step per answer token), so it may differ from a fresh prefill of the
same tokens by float rounding, as llama.cpp's and SGLang's reuse does. Greedy answers agree in the
tests (fp32); a near tie in bf16 could go either way.

The engine's prefill (`PromptCache.prefill`) calls `begin` with its plan, assembles what it returns
and `unlock`s; the request's owner (the engine's decode loop, the batcher) calls `end` with the
request's cache when the answer is done.

Not here: making the plan (engine/planning/plan.py; it runs whole, cache or no cache, so the recovery passes
that run the model, `selective` and `attend`, still run over the whole prompt), models with
sliding-window layers (`supported` says no: transformers' own cache of them keeps only a window; the
engine's reserved cache keeps every token, but a span kept here was not checked against a window),
sharing across processes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from rag_promptcache.engine.prompt.compiler import Piece
from rag_promptcache.engine.prefix.prefix_tree import Node, PrefixTree, TreeStats
from rag_promptcache.model.positions import KVGeometry
from rag_promptcache.store.base import ModuleKV

Label = tuple  # (token id, position) computed here; (token id, position, store key, offset) from a module
KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [L, H, tokens, D], keys post-RoPE at their positions
PREFIX = "\x00prefix:"  # unit names of reused spans in a spliced plan; a PML module name cannot contain \x00
MAX_LOGITS = 64  # prompts whose last token's logits are kept for exact repeats


def token_labels(pieces: Sequence[Piece], sources: Mapping[str, str]) -> tuple[Label, ...]:
    """One label per token of `pieces` (in sequence order); `sources`: store key of each cached unit."""
    out: list[Label] = []
    for p in pieces:
        if p.cached:
            src = sources[p.unit]
            out.extend((t, p.position + i, src, p.offset + i) for i, t in enumerate(p.token_ids))
        else:
            out.extend((t, p.position + i) for i, t in enumerate(p.token_ids))
    return tuple(out)


def supported(geometry: KVGeometry) -> bool:
    """Whether a cache of this model holds every token's KV (no sliding-window layers)."""
    return all(t == "full_attention" for t in geometry.layer_types)


@dataclass(frozen=True, slots=True)
class Reuse:
    """What a request takes from the prefix cache: its first `num_tokens` tokens' KV, in `spans`
    (each span's KV and how many of its tokens are used), with `handle` locked while they are copied;
    and the labels of its whole prompt, to store what it computed at its end."""

    labels: tuple[Label, ...]
    num_tokens: int = 0
    spans: tuple[tuple[KV, int], ...] = ()
    handle: Node[KV] | None = None
    logits: torch.Tensor | None = None  # [V] fp32: a repeat's (every token reused), so no forward runs


def splice(pieces: Sequence[Piece], kvs: Mapping[str, ModuleKV], reuse: Reuse) -> tuple[list[Piece], dict[str, ModuleKV]]:
    """The plan's pieces and module KV with the first `reuse.num_tokens` tokens taken from `reuse`:
    cached pieces at their own positions (no relocation: the shift is 0), then the rest of the plan.
    The assembler puts them first in the cache, so the new tokens attend to them as to any module."""
    m = reuse.num_tokens
    out: list[Piece] = []
    out_kvs: dict[str, ModuleKV] = {}
    seq = 0
    for (keys, values), n in reuse.spans:
        # keys, values: [L, H, span, D]; a span is cut into runs of consecutive positions (a piece's form)
        run = 0
        while run < n:
            labels = reuse.labels[seq + run : seq + n]
            end = next((i for i in range(1, len(labels)) if labels[i][1] != labels[0][1] + i), len(labels))
            ids = tuple(int(label[0]) for label in labels[:end])
            name = f"{PREFIX}{len(out)}"
            # a ModuleKV only as the assembler's input (never stored): the span's own KV, at its own positions
            out_kvs[name] = ModuleKV(keys[:, :, run : run + end], values[:, :, run : run + end], labels[0][1], ids,
                                     "", "prefix")
            out.append(Piece(ids, labels[0][1], name))
            run += end
        seq += n
    assert seq == m, f"{seq=} {m=}"
    seq = 0
    for p in pieces:
        n = len(p.token_ids)
        k = min(max(m - seq, 0), n)
        if k < n:
            out.append(p if k == 0 else Piece(p.token_ids[k:], p.position + k, p.unit, p.offset + k))
        seq += n
    out_kvs |= {p.unit: kvs[p.unit] for p in out if p.cached and p.unit not in out_kvs}
    return out, out_kvs


def cache_slots(pieces: Sequence[Piece]) -> list[int]:
    """For each token of `pieces` in sequence order, its slot in the cache the assembler builds from them:
    cached pieces first (in sequence order), then the new tokens (engine/kv/assemble.py)."""
    num_cached = sum(len(p.token_ids) for p in pieces if p.cached)
    slots: list[int] = []
    cached_at, new_at = 0, num_cached
    for p in pieces:
        n = len(p.token_ids)
        if p.cached:
            slots.extend(range(cached_at, cached_at + n))
            cached_at += n
        else:
            slots.extend(range(new_at, new_at + n))
            new_at += n
    return slots


@torch.inference_mode()
def gather(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], slots: Sequence[int]) -> KV:
    """The KV at `slots` of a cache given per layer (keys[i], values[i]: [H, capacity, D]), copied out in
    that order → keys, values [L, H, len(slots), D]."""
    first = keys[0]
    index = torch.tensor(slots, dtype=torch.long, device=first.device)
    out_k = first.new_empty(len(keys), first.shape[0], len(slots), first.shape[2])
    out_v = torch.empty_like(out_k)
    for i, (k, v) in enumerate(zip(keys, values)):
        torch.index_select(k, 1, index, out=out_k[i])
        torch.index_select(v, 1, index, out=out_v[i])
    return out_k, out_v


def cache_layers(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """A one-sequence cache's KV per layer ([H, length, D] each) and its length in tokens."""
    keys = [layer.keys[0] for layer in cache.layers]  # layer.keys: [1, H, length, D]
    values = [layer.values[0] for layer in cache.layers]
    return keys, values, min(k.shape[1] for k in keys)


@torch.inference_mode()
def _split(kv: KV, at: int) -> tuple[KV, KV]:
    # copies, not views: a view would keep the whole span's memory alive after the other half is evicted
    keys, values = kv
    return ((keys[:, :, :at].clone(), values[:, :, :at].clone()),
            (keys[:, :, at:].clone(), values[:, :, at:].clone()))


def _num_bytes(kv: KV) -> int:
    return sum(t.numel() * t.element_size() for t in kv)


@dataclass(frozen=True, slots=True)
class PrefixUse:
    """One request's use of the prefix cache: what it reused (`reuse`, locked from `begin` until
    `unlock`, which the prefill calls once the spans are copied into the request's cache), its plan's
    pieces and module KV with that prefix spliced in (what to assemble), and where each prompt token
    lies in the assembled cache (`slots`, in sequence order), for `end`."""

    reuse: Reuse
    pieces: tuple[Piece, ...]
    kvs: Mapping[str, ModuleKV]
    slots: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.reuse.num_tokens

    @property
    def repeat(self) -> bool:
        """Every prompt token reused, with the logits after them: no forward to run."""
        return self.reuse.logits is not None


class PrefixCache:
    """The KV of recent requests by token labels, at most `max_bytes` of it (least recently used
    spans go first). Thread-safe: the tree has one lock.

    A request's spans are locked only while its prefill copies them into its own cache: after that
    it holds its own copy, and at its end (`end`) it stores from that copy whatever the tree lacks by
    then, its reused prefix included if that was evicted meanwhile. So no lock outlives a prefill."""

    def __init__(self, max_bytes: int) -> None:
        self.tree: PrefixTree[KV] = PrefixTree(max_bytes, split=_split)
        self._logits: OrderedDict[tuple[Hashable, tuple[Label, ...]], torch.Tensor] = OrderedDict()
        self._logits_lock = threading.Lock()
        self.num_repeats = 0

    def begin(self, namespace: Hashable, labels: Sequence[Label], pieces: Sequence[Piece],
              kvs: Mapping[str, ModuleKV]) -> PrefixUse:
        """A request's prefill is about to assemble `pieces` (labelled `labels`): the longest stored
        prefix, short of the last token (whose logits the prefill computes), locked, spliced into them;
        all of them, with their logits, for a repeat. The caller owes an `unlock` once it has assembled them."""
        labels = tuple(labels)
        reuse = self._repeat(namespace, labels)
        if reuse is None:
            m = self.tree.match(namespace, labels[:-1], lock=True)
            reuse = Reuse(labels, m.num_tokens, m.spans, m.handle)
        if reuse.num_tokens:
            pieces, kvs = splice(pieces, kvs, reuse)
        return PrefixUse(reuse, tuple(pieces), kvs, tuple(cache_slots(pieces)))

    def _repeat(self, namespace: Hashable, labels: tuple[Label, ...]) -> Reuse | None:
        with self._logits_lock:
            logits = self._logits.get((namespace, labels))
            if logits is not None:
                self._logits.move_to_end((namespace, labels))
        if logits is None:
            return None
        m = self.tree.match(namespace, labels, lock=True)
        if m.num_tokens < len(labels):  # part of the prompt's KV was evicted: a prefill after all
            self.tree.release(m.handle)
            return None
        with self._logits_lock:
            self.num_repeats += 1
        return Reuse(labels, m.num_tokens, m.spans, m.handle, logits.clone())

    def keep_logits(self, namespace: Hashable, use: PrefixUse, logits: torch.Tensor) -> None:
        """A prefill of `use`'s prompt finished with `logits` [V] (fp32) after its last token: keep a copy
        for a repeat of it (which also needs the prompt's KV, stored by `end`)."""
        if use.repeat or not use.reuse.labels:
            return
        key = (namespace, use.reuse.labels)
        with self._logits_lock:
            self._logits[key] = logits.detach().clone()
            self._logits.move_to_end(key)
            while len(self._logits) > MAX_LOGITS:
                self._logits.popitem(last=False)

    def unlock(self, use: PrefixUse) -> None:
        self.tree.release(use.reuse.handle)

    def num_reusable(self, namespace: Hashable, labels: Sequence[Label]) -> int:
        """How many tokens of a prompt labelled `labels` a prefill would take from here now (the cost
        model's count; records no use)."""
        labels = tuple(labels)
        with self._logits_lock:
            repeat = (namespace, labels) in self._logits
        held = self.tree.num_held(namespace, labels)
        return held if repeat and held == len(labels) else min(held, len(labels) - 1)

    def end(self, namespace: Hashable, use: PrefixUse, keys: Sequence[torch.Tensor],
            values: Sequence[torch.Tensor], length: int, answer: Sequence[int], answer_start: int) -> int:
        """The request is done: keep its prompt's KV and its answer's, from its cache (per layer,
        [H, capacity, D], `length` tokens written: the prompt's, then the answer's) → tokens newly
        stored. Only answer tokens the model was fed count (not the last one sampled, nor a rejected
        draft's KV past the end)."""
        prompt = len(use.slots)
        fed = max(min(len(answer) - 1, length - prompt), 0)
        labels = use.reuse.labels + tuple((t, answer_start + i) for i, t in enumerate(answer[:fed]))
        slots = (*use.slots, *range(prompt, prompt + fed))
        # only copy what the tree lacks by now: a twin request may have stored more, or evictions taken some
        held = self.tree.num_held(namespace, labels)
        if held >= len(labels):
            return 0
        kv = gather(keys, values, slots[held:])
        return self.tree.insert(namespace, labels, kv, _num_bytes(kv), start=held)

    def stats(self) -> TreeStats:
        return self.tree.stats()


class NullPrefixCache:
    """The prefix cache off: nothing is reused, nothing kept."""

    num_repeats = 0

    def begin(self, namespace: Hashable, labels: Sequence[Label], pieces: Sequence[Piece],
              kvs: Mapping[str, ModuleKV]) -> PrefixUse:
        return PrefixUse(Reuse(()), tuple(pieces), kvs, ())

    def unlock(self, use: PrefixUse) -> None:
        pass

    def keep_logits(self, namespace: Hashable, use: PrefixUse, logits: torch.Tensor) -> None:
        pass

    def num_reusable(self, namespace: Hashable, labels: Sequence[Label]) -> int:
        return 0

    def end(self, namespace: Hashable, use: PrefixUse, keys: Sequence[torch.Tensor],
            values: Sequence[torch.Tensor], length: int, answer: Sequence[int], answer_start: int) -> int:
        return 0

    def stats(self) -> TreeStats:
        return TreeStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)


def make_prefix_cache(max_bytes: int, geometry: KVGeometry) -> PrefixCache | NullPrefixCache:
    """`max_bytes` 0, or a model whose cache does not hold every token (`supported`): off."""
    if max_bytes < 0:
        raise ValueError(f"the prefix cache's byte budget must be >= 0 (0 turns it off), got {max_bytes}")
    return PrefixCache(max_bytes) if max_bytes and supported(geometry) else NullPrefixCache()
