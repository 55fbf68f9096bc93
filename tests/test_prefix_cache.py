"""The engine side of the prefix tree: labels, splicing a plan, cache slots, and KV stored and reused
through real caches. The engine tests (generation with the prefix cache on equals it off) are below
these, on tiny random-weight models."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from rag_promptcache.engine.prompt.compiler import Piece
from rag_promptcache.engine.prefix.prefix_cache import (
    PREFIX, NullPrefixCache, PrefixCache, cache_layers, cache_slots, gather, token_labels,
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
    labels = token_labels(pieces, {"doc": "k"})
    reused = torch.full((L, H, 5, D), 7.0)
    cache = PrefixCache(10**6)
    cache.tree.insert(NS, labels[:5], (reused, -reused), 2 * reused.numel() * 4)
    use = cache.begin(NS, labels, pieces, {"doc": doc})
    assert use.num_tokens == 5  # 1 2 10 11 12: the prefix stops inside the module
    assert cache.stats().num_locked == 1  # while the prefill copies it
    assert [(p.token_ids, p.position, p.unit, p.offset) for p in use.pieces] == [
        ((1, 2, 10, 11, 12), 0, PREFIX + "0", 0),
        ((13,), 5, "doc", 3),
        ((3, 4), 6, None, 0),
    ]
    assert torch.equal(use.kvs[PREFIX + "0"].keys, reused) and use.kvs[PREFIX + "0"].start == 0
    assert use.kvs["doc"] is doc
    assert use.slots == (0, 1, 2, 3, 4, 5, 6, 7)  # prefix, then the doc's last token (cached), then 3 4
    cache.unlock(use)
    assert cache.stats().num_locked == 0


def test_a_span_with_a_position_gap_becomes_two_pieces():
    labels = ((1, 0), (2, 1), (3, 10), (4, 11))  # the schema layout leaves gaps
    cache = PrefixCache(10**6)
    kv = torch.arange(L * H * 4 * D, dtype=torch.float32).reshape(L, H, 4, D)
    cache.tree.insert(NS, labels, (kv, kv), 100)
    pieces = [Piece((1, 2), 0), Piece((3, 4, 5), 10)]
    use = cache.begin(NS, labels + ((5, 12),), pieces, {})
    assert [(p.token_ids, p.position) for p in use.pieces] == [((1, 2), 0), ((3, 4), 10), ((5,), 12)]
    assert torch.equal(use.kvs[use.pieces[1].unit].keys, kv[:, :, 2:4])
    cache.unlock(use)


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
    cache.unlock(use)
    assert use.num_tokens == 7
    assert [(p.token_ids, p.position, p.cached) for p in use.pieces] == [((1, 2, 10, 11, 3, 20, 21), 0, True),
                                                                          ((30, 31), 7, False)]
    assert torch.equal(use.kvs[use.pieces[0].unit].keys, in_order) and set(use.kvs) == {use.pieces[0].unit}
    assert use.slots == tuple(range(9))
    s = cache.stats()
    assert s.num_bytes == 2 * in_order.numel() * 4 and s.num_locked == 0 and s.num_hits == 1


def test_a_module_assembled_in_one_request_and_computed_in_another_is_not_shared():
    """Turn 1 computes module b (recovery recomputes it next to the question); turn 2 takes b from the
    store: equal token ids, other KV, so only the tokens before b are reused."""
    cache = PrefixCache(10**6)
    turn1 = [Piece((1,), 0), Piece((10, 11), 1, "a"), Piece((12, 13), 3), Piece((2,), 5)]
    labels1 = token_labels(turn1, {"a": "key-a"})
    use = cache.begin(NS, labels1, turn1, {"a": kv_of((10, 11), 1, 0.0)})
    cache.unlock(use)
    k, v, n = cache_layers(cache_from(torch.randn(L, H, 6, D), torch.randn(L, H, 6, D)))
    cache.end(NS, use, k, v, n, [], 6)
    turn2 = [Piece((1,), 0), Piece((10, 11), 1, "a"), Piece((12, 13), 3, "b"), Piece((5,), 5)]
    use = cache.begin(NS, token_labels(turn2, {"a": "key-a", "b": "key-b"}), turn2,
                      {"a": kv_of((10, 11), 1, 0.0), "b": kv_of((12, 13), 3, 1.0)})
    assert use.num_tokens == 3
    cache.unlock(use)


def test_the_budget_holds_and_an_evicted_prefix_is_stored_again_from_the_request():
    per_token = 2 * L * H * D * 4
    cache = PrefixCache(3 * per_token)
    pieces = [Piece((0, 1, 2, 3, 4), 0)]
    labels = token_labels(pieces, {})
    keys = torch.randn(L, H, 6, D)
    k, v, _ = cache_layers(cache_from(keys, keys))

    def run(n: int) -> int:  # a request over the first n tokens: begin, prefill (nothing here), end
        use = cache.begin(NS, labels[:n], [Piece(pieces[0].token_ids[:n], 0)], {})
        cache.unlock(use)
        return cache.end(NS, use, k, v, n, [], n)

    assert run(5) == 0 and cache.stats().num_bytes == 0  # 5 tokens never fit in 3
    assert run(3) == 3 and cache.stats().num_bytes == 3 * per_token
    assert run(3) == 0  # held already: nothing copied
    # a request reusing 2 tokens; another evicts them before it ends: it stores them again from its own cache
    use = cache.begin(NS, labels[:3], [Piece((0, 1, 2), 0)], {})
    cache.unlock(use)
    assert use.num_tokens == 2
    cache.tree.evict(0)
    assert cache.end(NS, use, k, v, 3, [], 3) == 3
    assert cache.tree.match(NS, labels[:3]).num_tokens == 3
    got = torch.cat([kv[0][:, :, :n] for kv, n in cache.tree.match(NS, labels[:3]).spans], dim=2)
    assert torch.equal(got, keys[:, :, :3])


def test_off_is_its_own_class():
    off = NullPrefixCache()
    pieces = [Piece((1, 2), 0)]
    use = off.begin(NS, token_labels(pieces, {}), pieces, {})
    assert use.num_tokens == 0 and use.pieces == tuple(pieces)
    off.unlock(use)
    assert off.end(NS, use, [], [], 0, [5], 2) == 0 and off.stats().num_bytes == 0


def test_follow_ups_over_the_same_modules_keep_the_previous_order():
    from rag_promptcache.rag.retrieval import keep_order

    # turn 2 ranks the same modules differently: it imports them as turn 1 did, so turn 1's prompt is its prefix
    assert keep_order([["a", "b", "c"], ["c", "a", "b"]]) == ["a", "b", "c"]
    # and turn 3 too, back through every turn over the same set
    assert keep_order([["a", "b", "c"], ["b", "a", "c"], ["c", "b", "a"]]) == ["a", "b", "c"]
    # other modules: the turn's own ranking, which later turns then keep
    assert keep_order([["a", "b"], ["a", "d"], ["d", "a"]]) == ["a", "d"]
    assert keep_order([["x"]]) == ["x"] and keep_order([[]]) == []


# -- over the engine: with the prefix cache on, answers equal those with it off --------------------

from rag_promptcache.engine import PromptCache  # noqa: E402
from rag_promptcache.pml.build import prompt_pml  # noqa: E402
from rag_promptcache.store import MemoryStore  # noqa: E402
from tests.tiny import build  # noqa: E402

DOCS = {
    "a": "The quick brown fox jumps over the lazy dog near the river bank.",
    "b": "Paris is the capital of France, and the Seine runs through it.",
    "c": "Mount Fuji is the highest mountain in Japan, near Tokyo.",
    "d": "The Amazon river carries more water than any other river.",
}
CHAT_SCHEMA = ('<schema name="docs"><system>Answer from the documents.\n'
               + "".join(f'<module name="{n}">{t}</module>' for n, t in DOCS.items()) + "</system></schema>")
GREEDY = dict(max_new_tokens=10, ignore_eos=True)


def tiny_engine(tokenizer, **kwargs) -> PromptCache:
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(),
                     **{"recovery": "last:2", "fallback": "never", **kwargs})
    pc.add_schema(CHAT_SCHEMA)
    return pc


def chat(modules, turns) -> str:
    return prompt_pml("docs", modules, turns)


def conversation(pc: PromptCache, modules_per_turn, questions, generate=None, sampling=GREEDY):
    """Turns of a chat; each follow-up repeats the earlier questions and answers → the results."""
    generate = generate or pc.generate
    turns: list[tuple[str, str]] = []
    results = []
    for modules, q in zip(modules_per_turn, questions):
        r = generate(chat(modules, [*turns, ("user", q)]), **sampling)
        results.append(r)
        turns += [("user", q), ("assistant", r.text)]
    return results


QUESTIONS = ["Where is Paris?", "And Fuji?", "Which river is long?"]


def test_follow_up_turns_reuse_the_previous_turn_and_answer_as_with_the_cache_off(tokenizer):
    on, off = tiny_engine(tokenizer), tiny_engine(tokenizer, prefix_cache_bytes=0)
    same = [["a", "b", "c"]] * 3
    got, want = conversation(on, same, QUESTIONS), conversation(off, same, QUESTIONS)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.num_prefix_tokens for r in want] == [0, 0, 0]
    assert got[0].num_prefix_tokens == 0
    for before, r in zip(got, got[1:]):
        # the whole previous prompt at least (its answer too, as far as its text tokenizes back the same)
        assert r.num_prefix_tokens >= before.prompt_tokens, (before, r)
        assert r.cached_tokens >= r.num_prefix_tokens and r.computed_tokens == r.prompt_tokens - r.cached_tokens
    assert on.prefix_cache.stats().num_hits == 2 and off.prefix_cache.stats().num_bytes == 0


def test_a_module_recovery_recomputed_before_but_assembles_now_is_not_reused(tokenizer):
    """Turn 1 imports a b c: `last:2` computes b and c against what precedes them. Turn 2 imports
    a b c d: it computes c and d, and assembles b from the store. Equal token ids up to d, but b's KV
    differs, so only what comes before b is reused; the answer is the one of the cache off."""
    on, off = tiny_engine(tokenizer), tiny_engine(tokenizer, prefix_cache_bytes=0)
    modules = [["a", "b", "c"], ["a", "b", "c", "d"]]
    got, want = conversation(on, modules, QUESTIONS[:2]), conversation(off, modules, QUESTIONS[:2])
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    plan = on.plan(chat(["a", "b", "c", "d"], [("user", "x")]))
    before_b = 0
    for p in plan.pieces:
        if p.unit == "b":
            break
        before_b += len(p.token_ids)
    assert 0 < got[1].num_prefix_tokens <= before_b


@pytest.mark.parametrize("prefill_chunk", [None, 3])  # whole prefills, and chunked ones
def test_the_batcher_reuses_and_keeps_prefixes_as_the_engine_does(tokenizer, prefill_chunk):
    on, off = tiny_engine(tokenizer), tiny_engine(tokenizer, prefix_cache_bytes=0)
    same = [["b", "c"]] * 2
    with on.scheduler(max_batch=2, prefill_chunk=prefill_chunk) as batcher:
        got = conversation(on, same, QUESTIONS[:2], generate=lambda p, **kw: batcher.submit(p, **kw).consume())
    want = conversation(off, same, QUESTIONS[:2])
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert got[1].num_prefix_tokens >= got[0].prompt_tokens
    # and what the batcher kept serves the engine's own loop
    again = on.generate(chat(["b", "c"], [("user", QUESTIONS[0]), ("assistant", got[0].text), ("user", "Why?")]),
                        **GREEDY)
    assert again.num_prefix_tokens >= got[0].prompt_tokens


def test_full_prefill_and_compare_reuse_nothing(tokenizer):
    pc = tiny_engine(tokenizer)
    prompt = chat(["a"], [("user", "Where?")])
    pc.generate(prompt, **GREEDY)
    assert pc.generate(prompt, use_cache=False, **GREEDY).num_prefix_tokens == 0
    assert pc.generate(prompt, **GREEDY).num_prefix_tokens == pc.plan(prompt).num_tokens  # a repeat: all of it
    assert pc.compare(prompt) == tiny_engine(tokenizer).compare(prompt)  # as if no request came before


def test_the_prefix_cache_stays_within_its_byte_budget(tokenizer):
    probe = tiny_engine(tokenizer)
    probe.generate(chat(["a"], [("user", "q0")]), **GREEDY)
    one = probe.prefix_cache.stats().num_bytes  # about one request's prompt and answer
    pc = tiny_engine(tokenizer, prefix_cache_bytes=int(one * 2.5))
    for i, modules in enumerate([["a"], ["b"], ["c"], ["d"], ["a", "b"], ["c", "d"]]):
        pc.generate(chat(modules, [("user", f"question {i}")]), **GREEDY)
        s = pc.prefix_cache.stats()
        assert s.num_bytes <= s.max_bytes and s.num_locked == 0
    assert s.num_evictions > 0 and s.num_bytes > 0


def test_the_budget_comes_from_the_store_config(tokenizer, monkeypatch):
    monkeypatch.setenv("RAG_PROMPTCACHE_STORE_PREFIX_CACHE_BYTES", "1MiB")
    assert tiny_engine(tokenizer).prefix_cache.stats().max_bytes == 2**20
    monkeypatch.setenv("RAG_PROMPTCACHE_STORE_PREFIX_CACHE_BYTES", "0")
    assert isinstance(tiny_engine(tokenizer).prefix_cache, NullPrefixCache)
    with pytest.raises(ValueError, match="prefix cache's byte budget"):
        tiny_engine(tokenizer, prefix_cache_bytes=-1)


@pytest.mark.smollm
def test_smollm2_chat_turns_with_the_prefix_cache_answer_as_without(smollm):
    model, tokenizer = smollm
    on = PromptCache(model, tokenizer, store=MemoryStore())
    off = PromptCache(model, tokenizer, store=MemoryStore(), prefix_cache_bytes=0)
    for pc in (on, off):
        pc.add_schema(CHAT_SCHEMA)
    same = [["a", "b", "c", "d"]] * 3
    questions = ["What is the capital of France?", "Which river runs through it?", "What is the highest mountain in Japan?"]
    answers = dict(max_new_tokens=24)  # to the model's own end of turn, as a chat goes
    got, want = conversation(on, same, questions, sampling=answers), conversation(off, same, questions, sampling=answers)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    for before, r, q in zip(got, got[1:], questions[1:]):
        # the previous prompt and answer, all but the answer's last token (sampled, never fed: no KV), as far
        # as the answer's text tokenizes back to the ids it was sampled as (BPE may split it otherwise)
        fed, again = before.token_ids[:-1], tokenizer.encode(before.text, add_special_tokens=False)
        same = next((i for i, (a, b) in enumerate(zip(fed, again)) if a != b), min(len(fed), len(again)))
        assert r.num_prefix_tokens == before.prompt_tokens + same, (before, r)
        # computed: the answer's tokens past that, the end of its turn, the new question and the chat markup
        # around it (the answer's last token, <|im_end|>, newlines, role headers: 12 at most), not the context
        assert r.computed_tokens <= len(again) - same + len(tokenizer.encode(q, add_special_tokens=False)) + 12, r


# -- over a corpus: CorpusChat keeps a follow-up's modules in the previous turn's order ---------------

CORPUS_DOCS = {
    "cats.txt": "Cats sleep sixteen hours a day. A cat purrs when it is content.",
    "bread.txt": "Sourdough bread rises with wild yeast fed with flour and water.",
    "tides.txt": "Tides follow the moon; spring tides come at new and full moon.",
    "zebra.txt": "Zebras have stripes that confuse biting flies.",
}


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    from rag_promptcache.rag.corpus import Corpus
    from tests.tiny_llama import save_tiny_llama

    docs = tmp_path_factory.mktemp("docs")
    for name, text in CORPUS_DOCS.items():
        (docs / name).write_text(text)
    model = save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    corpus = Corpus.build([docs], tmp_path_factory.mktemp("corpus") / "c", model=model, progress=False,
                          redis_url="", dtype="float32")
    # The cached path on every turn (tests/conftest.py): under "auto" a loaded machine's cost model once ran
    # turn 1 as a full prefill and turn 2 cached, whose prefix labels (with module sources) differ from the
    # full path's, so turn 2 reused its modules but not turn 1's prompt.
    corpus.engine.fallback = "never"
    yield corpus
    corpus.close()


def test_corpus_chat_follow_ups_keep_the_order_and_reuse_the_previous_turn(tiny_corpus):
    import re

    from rag_promptcache.rag.chat import CorpusChat

    chat = CorpusChat(tiny_corpus)
    pc = tiny_corpus.engine
    off = PromptCache(pc.model, pc.tokenizer, store=pc.store, mode=pc.mode, prefix_cache_bytes=0)
    off.add_schema(pc.schema(tiny_corpus.manifest.name))
    turns: list[tuple[str, str]] = []
    rankings, orders, results = [], [], []
    for q in ["How long do cats sleep?", "What makes sourdough rise?", "When do spring tides come?"]:
        cp = chat.chat_prompt([*turns, ("user", q)], k=4, max_new_tokens=8)
        r = pc.generate(cp.prompt, max_new_tokens=8)
        assert off.generate(cp.prompt, max_new_tokens=8).token_ids == r.token_ids
        rankings.append([s.module_id for s in cp.sources])
        orders.append(re.findall(r"<([^ />]+)/>", cp.prompt))
        results.append(r)
        turns += [("user", q), ("assistant", r.text)]
    assert len(set(map(tuple, rankings))) > 1  # each question ranks the 4 chunks its own way ...
    assert orders[0] == orders[1] == orders[2] == tiny_corpus.order(rankings[0])  # ... imported as in turn 1
    for before, r in zip(results, results[1:]):
        # the previous prompt but its last token: the random model answers newlines, which tokenize back
        # merged with the "\n" that opens the assistant turn (a real answer is reused too: the SmolLM2 test)
        assert r.num_prefix_tokens >= before.prompt_tokens - 1, (before, r)


def test_corpus_ask_follow_ups_keep_the_order_and_answer_as_with_the_cache_off(tiny_corpus):
    import re

    pc = tiny_corpus.engine
    off = PromptCache(pc.model, pc.tokenizer, store=pc.store, mode=pc.mode, prefix_cache_bytes=0)
    off.add_schema(pc.schema(tiny_corpus.manifest.name))
    history: list[tuple[str, str]] = []
    orders, answers = [], []
    for q in ["How long do cats sleep?", "What makes sourdough rise?", "When do spring tides come?"]:
        a = tiny_corpus.ask(q, k=4, history=history, max_new_tokens=8)
        assert off.generate(a.prompt, max_new_tokens=8, no_repeat_ngram=6).text.strip() == a.answer
        orders.append(re.findall(r"<([^ />]+)/>", a.prompt))
        answers.append(a)
        history.append((q, a.answer))
    assert orders[0] == orders[1] == orders[2]  # the same modules, imported as in turn 1
    for before, a in zip(answers, answers[1:]):
        assert a.cached_tokens >= before.prompt_tokens - 1, (before, a)  # the previous prompt, reused
