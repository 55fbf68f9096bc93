"""The engine side of the prefix tree: labels, splicing a plan, cache slots, and KV stored and reused
through real caches. The engine tests (generation with the prefix cache on equals it off) are below
these, on tiny random-weight models."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rag_promptcache.engine.compiler import Piece
from rag_promptcache.engine.prefix_cache import PREFIX, PrefixCache, cache_slots, gather, splice, token_labels
from rag_promptcache.store.base import ModuleKV

L, H, D = 2, 3, 4
NS = ("fp", "shared_prefix")


def kv_of(token_ids, start, tag: float) -> ModuleKV:
    """Distinct values per token: keys[l, h, i, d] = tag + position + l/10 (tells tokens and layers apart)."""
    n = len(token_ids)
    pos = torch.arange(start, start + n, dtype=torch.float32)
    keys = tag + pos[None, None, :, None] + torch.arange(L)[:, None, None, None] / 10 + torch.zeros(L, H, n, D)
    return ModuleKV(keys, -keys, start, tuple(token_ids), "fp", "shared_prefix")


def cache_from(keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
    """A cache holding keys, values [L, H, S, D]."""
    cache = DynamicCache()
    for i in range(L):
        cache.update(keys[i][None], values[i][None], i)
    return cache


def test_labels_say_how_each_token_is_produced():
    pieces = [Piece((5, 6), 0), Piece((7, 8), 2, "doc", 1), Piece((9,), 4)]
    assert token_labels(pieces, {"doc": "key-doc"}) == (
        (5, 0), (6, 1), (7, 2, "key-doc", 1), (8, 3, "key-doc", 2), (9, 4),
    )
    # the same ids, computed rather than assembled, are other labels: their KV differs
    assert token_labels([Piece((5, 6, 7, 8, 9), 0)], {})[2] != (7, 2, "key-doc", 1)


def test_cache_slots_follow_the_assembler_cached_first():
    pieces = [Piece((1, 2), 0), Piece((3, 4, 5), 2, "a"), Piece((6,), 5), Piece((7, 8), 6, "b")]
    # cached: 3 4 5 7 8 -> slots 0..4; new: 1 2 6 -> slots 5, 6, 7
    assert cache_slots(pieces) == [5, 6, 0, 1, 2, 7, 3, 4]


def test_gather_copies_slots_in_sequence_order():
    keys = torch.arange(L * H * 6 * D, dtype=torch.float32).reshape(L, H, 6, D)
    cache = cache_from(keys, keys + 1000)
    k, v = gather(cache, [4, 0, 2])
    assert torch.equal(k, keys[:, :, [4, 0, 2]]) and torch.equal(v, keys[:, :, [4, 0, 2]] + 1000)
    keys.zero_()  # a copy, not a view of the cache
    assert k.abs().sum() > 0


def test_splice_takes_the_prefix_from_the_cache_and_the_rest_from_the_plan():
    doc = kv_of((10, 11, 12, 13), 0, tag=100.0)
    pieces = [Piece((1, 2), 0), Piece((10, 11, 12, 13), 2, "doc"), Piece((3, 4), 6)]
    kvs = {"doc": doc}
    labels = token_labels(pieces, {"doc": "k"})
    reused = torch.full((L, H, 5, D), 7.0)
    cache = PrefixCache(10**6)
    cache.tree.insert(NS, labels[:5], (reused, -reused), 2 * reused.numel() * 4)
    reuse = cache.lookup(NS, labels)
    assert reuse.num_tokens == 5  # 1 2 10 11 12: the prefix stops inside the module
    out, out_kvs = splice(pieces, kvs, reuse, "fp", "shared_prefix")
    assert [(p.token_ids, p.position, p.unit, p.offset) for p in out] == [
        ((1, 2, 10, 11, 12), 0, PREFIX + "0", 0),
        ((13,), 5, "doc", 3),
        ((3, 4), 6, None, 0),
    ]
    assert torch.equal(out_kvs[PREFIX + "0"].keys, reused) and out_kvs[PREFIX + "0"].start == 0
    assert out_kvs["doc"] is doc
    cache.release(reuse)
    assert cache.stats().num_locked == 0


def test_a_span_with_a_position_gap_becomes_two_pieces():
    labels = ((1, 0), (2, 1), (3, 10), (4, 11))  # the schema layout leaves gaps
    cache = PrefixCache(10**6)
    kv = torch.arange(L * H * 4 * D, dtype=torch.float32).reshape(L, H, 4, D)
    cache.tree.insert(NS, labels, (kv, kv), 100)
    reuse = cache.lookup(NS, labels + ((5, 12),))
    out, out_kvs = splice([Piece((1, 2), 0), Piece((3, 4, 5), 10)], {}, reuse, "fp", "m")
    assert [(p.token_ids, p.position) for p in out] == [((1, 2), 0), ((3, 4), 10), ((5,), 12)]
    assert torch.equal(out_kvs[out[1].unit].keys, kv[:, :, 2:4])
    cache.release(reuse)


def test_store_keeps_what_the_request_computed_and_lookup_returns_it():
    cache = PrefixCache(10**6)
    pieces = [Piece((1, 2, 3), 0), Piece((4, 5), 3)]
    labels = token_labels(pieces, {})
    reuse = cache.lookup(NS, labels)
    assert reuse.num_tokens == 0
    keys = torch.randn(L, H, 7, D)
    kv_cache = cache_from(keys, keys * 2)  # 5 prompt tokens, then 2 answer tokens
    answer = ((6, 5), (7, 6))
    assert cache.store(NS, reuse, kv_cache, cache_slots(pieces) + [5, 6], answer) == 7
    # a follow-up: prompt, answer, a new question; everything but its own tokens comes back
    follow = labels + answer + ((8, 7), (9, 8))
    again = cache.lookup(NS, follow)
    assert again.num_tokens == 7
    got = torch.cat([k[:, :, :n] for (k, _), n in again.spans], dim=2)
    assert torch.equal(got, keys)
    cache.release(again)
    s = cache.stats()
    assert s.num_bytes == 2 * keys.numel() * 4 and s.num_locked == 0 and s.num_hits == 1


def test_store_copies_only_what_the_tree_lacks_and_the_budget_holds():
    per_token = 2 * L * H * D * 4
    cache = PrefixCache(3 * per_token)
    labels = tuple((t, t) for t in range(5))
    reuse = cache.lookup(NS, labels)
    keys = torch.randn(L, H, 5, D)
    assert cache.store(NS, reuse, cache_from(keys, keys), list(range(5))) == 0  # 5 tokens never fit 3
    assert cache.stats().num_bytes == 0
    short = labels[:3]
    reuse = cache.lookup(NS, short)
    assert cache.store(NS, reuse, cache_from(keys, keys), [0, 1, 2]) == 3
    reuse = cache.lookup(NS, short + ((9, 3),))
    assert reuse.num_tokens == 3
    assert cache.store(NS, reuse, cache_from(keys, keys), [3]) == 0  # 4 tokens would exceed; the prefix is locked
    assert cache.stats().num_bytes == 3 * per_token


def test_follow_ups_over_the_same_modules_keep_the_previous_order():
    from rag_promptcache.rag.chat import keep_order

    # turn 2 ranks the same modules differently: it imports them as turn 1 did, so turn 1's prompt is its prefix
    assert keep_order([["a", "b", "c"], ["c", "a", "b"]]) == ["a", "b", "c"]
    # and turn 3 too, back through every turn over the same set
    assert keep_order([["a", "b", "c"], ["b", "a", "c"], ["c", "b", "a"]]) == ["a", "b", "c"]
    # other modules: the turn's own ranking, which later turns then keep
    assert keep_order([["a", "b"], ["a", "d"], ["d", "a"]]) == ["a", "d"]
    assert keep_order([["x"]]) == ["x"] and keep_order([[]]) == []
