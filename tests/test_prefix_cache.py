"""The engine side of the prefix tree: labels, splicing a plan, cache slots, and KV stored and reused
through real caches. The engine tests (generation with the prefix cache on equals it off) are below
these, on tiny random-weight models."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from rag_promptcache.engine.compiler import Piece
from rag_promptcache.engine.prefix_cache import (
    PREFIX, NullPrefixCache, PrefixCache, cache_layers, cache_slots, gather, splice, token_labels,
)
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
    layer_keys, layer_values, length = cache_layers(cache_from(keys, keys + 1000))
    assert length == 6
    k, v = gather(layer_keys, layer_values, [4, 0, 2])
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
    out, out_kvs = splice(pieces, kvs, reuse)
    assert [(p.token_ids, p.position, p.unit, p.offset) for p in out] == [
        ((1, 2, 10, 11, 12), 0, PREFIX + "0", 0),
        ((13,), 5, "doc", 3),
        ((3, 4), 6, None, 0),
    ]
    assert torch.equal(out_kvs[PREFIX + "0"].keys, reused) and out_kvs[PREFIX + "0"].start == 0
    assert out_kvs["doc"] is doc
    cache.tree.release(reuse.handle)
    assert cache.stats().num_locked == 0


def test_a_span_with_a_position_gap_becomes_two_pieces():
    labels = ((1, 0), (2, 1), (3, 10), (4, 11))  # the schema layout leaves gaps
    cache = PrefixCache(10**6)
    kv = torch.arange(L * H * 4 * D, dtype=torch.float32).reshape(L, H, 4, D)
    cache.tree.insert(NS, labels, (kv, kv), 100)
    reuse = cache.lookup(NS, labels + ((5, 12),))
    out, out_kvs = splice([Piece((1, 2), 0), Piece((3, 4, 5), 10)], {}, reuse)
    assert [(p.token_ids, p.position) for p in out] == [((1, 2), 0), ((3, 4), 10), ((5,), 12)]
    assert torch.equal(out_kvs[out[1].unit].keys, kv[:, :, 2:4])
    cache.tree.release(reuse.handle)


def test_a_request_keeps_its_prompt_and_answer_and_a_follow_up_reuses_them():
    cache = PrefixCache(10**6)
    doc = kv_of((10, 11), 2, tag=100.0)
    pieces = [Piece((1, 2), 0), Piece((10, 11), 2, "doc"), Piece((3,), 4)]
    labels = token_labels(pieces, {"doc": "k"})
    use = cache.begin(NS, labels, pieces, {"doc": doc})
    assert use.num_tokens == 0 and use.slots == (2, 3, 0, 1, 4)
    # the request's cache: the doc's 2 tokens, the 3 new ones, then answer tokens 20 21 (22 sampled, not fed)
    keys = torch.randn(L, H, 8, D)
    k, v, length = cache_layers(cache_from(keys, keys * 2))
    assert cache.end(NS, use, k, v, length - 1, [20, 21, 22], 5) == 7
    in_order = keys[:, :, [2, 3, 0, 1, 4, 5, 6]]  # sequence order: 1 2 10 11 3, then 20 21
    # a follow-up: the prompt, the answer, a new question; all but the question comes back
    follow_pieces = [*pieces, Piece((20, 21, 30, 31), 5)]
    follow = token_labels(follow_pieces, {"doc": "k"})
    use = cache.begin(NS, follow, follow_pieces, {"doc": doc})
    assert use.num_tokens == 7
    assert [(p.token_ids, p.position, p.cached) for p in use.pieces] == [((1, 2, 10, 11, 3, 20, 21), 0, True),
                                                                          ((30, 31), 7, False)]
    assert torch.equal(use.kvs[use.pieces[0].unit].keys, in_order) and set(use.kvs) == {use.pieces[0].unit}
    assert use.slots == tuple(range(9))
    cache.abort(use)
    s = cache.stats()
    assert s.num_bytes == 2 * in_order.numel() * 4 and s.num_locked == 0 and s.num_hits == 1


def test_a_module_assembled_in_one_request_and_computed_in_another_is_not_shared():
    """Turn 1 computes module b (recovery recomputes it next to the question); turn 2 takes b from the
    store: equal token ids, other KV, so only the tokens before b are reused."""
    cache = PrefixCache(10**6)
    turn1 = [Piece((1,), 0), Piece((10, 11), 1, "a"), Piece((12, 13), 3), Piece((2,), 5)]
    labels1 = token_labels(turn1, {"a": "key-a"})
    use = cache.begin(NS, labels1, turn1, {"a": kv_of((10, 11), 1, 0.0)})
    k, v, n = cache_layers(cache_from(torch.randn(L, H, 6, D), torch.randn(L, H, 6, D)))
    cache.end(NS, use, k, v, n, [], 6)
    turn2 = [Piece((1,), 0), Piece((10, 11), 1, "a"), Piece((12, 13), 3, "b"), Piece((5,), 5)]
    use = cache.begin(NS, token_labels(turn2, {"a": "key-a", "b": "key-b"}), turn2,
                      {"a": kv_of((10, 11), 1, 0.0), "b": kv_of((12, 13), 3, 1.0)})
    assert use.num_tokens == 3
    cache.abort(use)


def test_store_copies_only_what_the_tree_lacks_and_the_budget_holds():
    per_token = 2 * L * H * D * 4
    cache = PrefixCache(3 * per_token)
    labels = tuple((t, t) for t in range(5))
    keys = torch.randn(L, H, 5, D)
    k, v, _ = cache_layers(cache_from(keys, keys))
    reuse = cache.lookup(NS, labels)
    assert cache.store(NS, reuse, k, v, list(range(5))) == 0  # 5 tokens never fit in 3
    assert cache.stats().num_bytes == 0
    short = labels[:3]
    reuse = cache.lookup(NS, short)
    assert cache.store(NS, reuse, k, v, [0, 1, 2]) == 3
    reuse = cache.lookup(NS, short + ((9, 3),))
    assert reuse.num_tokens == 3
    assert cache.store(NS, reuse, k, v, [3]) == 0  # a 4th token would not fit: the prefix is locked
    assert cache.stats().num_bytes == 3 * per_token and cache.stats().num_locked == 0


def test_off_is_its_own_class():
    off = NullPrefixCache()
    pieces = [Piece((1, 2), 0)]
    use = off.begin(NS, token_labels(pieces, {}), pieces, {})
    assert use.num_tokens == 0 and use.pieces == tuple(pieces)
    assert off.end(NS, use, [], [], 0, [5], 2) == 0 and off.stats().num_bytes == 0


def test_follow_ups_over_the_same_modules_keep_the_previous_order():
    from rag_promptcache.rag.chat import keep_order

    # turn 2 ranks the same modules differently: it imports them as turn 1 did, so turn 1's prompt is its prefix
    assert keep_order([["a", "b", "c"], ["c", "a", "b"]]) == ["a", "b", "c"]
    # and turn 3 too, back through every turn over the same set
    assert keep_order([["a", "b", "c"], ["b", "a", "c"], ["c", "b", "a"]]) == ["a", "b", "c"]
    # other modules: the turn's own ranking, which later turns then keep
    assert keep_order([["a", "b"], ["a", "d"], ["d", "a"]]) == ["a", "d"]
    assert keep_order([["x"]]) == ["x"] and keep_order([[]]) == []
