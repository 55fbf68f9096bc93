"""Several requests' prefills in one forward (`batch.mixed_step`, tiny random Llama, fp32): each gets the
logits and KV its own forward gives, with or without running rows riding in the same forward. And the
batcher's admission of whole prefills: "one" (a running stream waits for one prefill at most, prefills
waiting with no row running share a forward) against the default "all" (every admitted prefill before
the next step), each answer equal to the request's alone."""

from __future__ import annotations

import threading

import pytest
import torch

import rag_promptcache.engine.batching.batcher as batcher_module
from rag_promptcache.engine.batching.batch import BatchCache, decode_step, mixed_step
from rag_promptcache.engine.batching.batcher import Batcher
from rag_promptcache.engine.planning.prefill import Prefilling, start
from tests.test_batch import PROMPTS
from tests.test_chunked_prefill import TOL, _engine, _kv


@pytest.mark.parametrize("recovery", ["none", "first_k:2"])
@pytest.mark.parametrize("num_rows", [0, 2])
def test_one_forward_of_several_prefills_gives_each_ones_logits_and_kv(tokenizer, recovery, num_rows):
    pc = _engine("llama", tokenizer, recovery)
    firsts = [pc.prefill(pc.plan(p)) for p in PROMPTS[:num_rows]]
    apart, mixed = (BatchCache(pc.model.config, pc.geometry, 2, 8, pc.model.dtype, pc.model.device) for _ in "ab")
    for batch in (apart, mixed):
        for row, first in enumerate(firsts):
            batch.load(row, first.cache)
    ids = [int(f.logits.argmax()) for f in firsts]
    positions = [f.next_position for f in firsts]
    plans = [pc.plan(p) for p in (PROMPTS[3], PROMPTS[2], PROMPTS[1])]
    refs = [start(pc.model, plan, pc.relocator, pc.geometry).run(pc.model) for plan in plans]
    todos = [start(pc.model, plan, pc.relocator, pc.geometry) for plan in plans]
    assert len({t.num_new for t in todos}) == 3, "prefills of different lengths"
    rows, lasts = mixed_step(pc.model, mixed, ids, positions, [(t.cache, t.take()) for t in todos])
    assert rows.shape[0] == num_rows and len(lasts) == len(todos)
    if num_rows:
        assert float((rows - decode_step(pc.model, apart, ids, positions)).abs().max()) < TOL
        assert mixed.lengths == apart.lengths
    for plan, ref, todo, last in zip(plans, refs, todos, lasts):
        assert float((last - ref.logits).abs().max()) < TOL
        for a, b in zip(_kv(todo.cache, plan.num_tokens), _kv(ref.cache, plan.num_tokens)):
            assert float((a - b).abs().max()) < TOL


def test_a_step_needs_rows_or_prefills(tokenizer):
    pc = _engine("llama", tokenizer)
    batch = BatchCache(pc.model.config, pc.geometry, 2, 8, pc.model.dtype, pc.model.device)
    with pytest.raises(AssertionError, match="neither rows nor prefills"), torch.inference_mode():
        mixed_step(pc.model, batch, [], [], [])


def _logged(monkeypatch) -> list[tuple[str, int, int]]:
    """Every forward the batcher runs, as (kind, running rows in it, prefills in it)."""
    log: list[tuple[str, int, int]] = []
    run, step, row, mixed = Prefilling.run, batcher_module.decode_step, batcher_module.decode_row, batcher_module.mixed_step

    def logged_run(self, model, tokens=None):
        log.append(("prefill", 0, 1))
        return run(self, model, tokens)

    monkeypatch.setattr(Prefilling, "run", logged_run)
    monkeypatch.setattr(batcher_module, "decode_step",
                        lambda m, b, ids, *a, **k: log.append(("step", len(ids), 0)) or step(m, b, ids, *a, **k))
    monkeypatch.setattr(batcher_module, "decode_row", lambda *a, **k: log.append(("step", 1, 0)) or row(*a, **k))
    monkeypatch.setattr(batcher_module, "mixed_step",
                        lambda m, b, ids, p, todo: log.append(("mixed", len(ids), len(todo))) or mixed(m, b, ids, p, todo))
    return log


def _gate(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """(armed, open): once `armed` is set, the batcher's next admission waits for `open`, so requests
    submitted meanwhile wait together."""
    armed, gate = threading.Event(), threading.Event()
    admit = Batcher._admit

    def gated(self):
        if armed.is_set():
            gate.wait(60)
        admit(self)

    monkeypatch.setattr(Batcher, "_admit", gated)
    return armed, gate


LATE = ((PROMPTS[1], 5), (PROMPTS[3], 5), (PROMPTS[2], 5))


def _late_while_running(pc, monkeypatch, admission: str) -> list[tuple[str, int, int]]:
    """One request running, then the three of `LATE` submitted to wait together, each getting its answer
    alone → the batcher's forwards (`_logged`)."""
    alone = [pc.generate(p, max_new_tokens=n, ignore_eos=True) for p, n in ((PROMPTS[0], 40), *LATE)]
    log = _logged(monkeypatch)
    armed, gate = _gate(monkeypatch)
    with Batcher(pc, max_batch=4, admission=admission) as s:
        first = s.submit(PROMPTS[0], max_new_tokens=40, ignore_eos=True)
        it = iter(first)
        next(it)  # running
        armed.set()
        late = [s.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in LATE]
        gate.set()  # three prefills wait together while a row decodes
        assert [h.consume().token_ids for h in late] == [a.token_ids for a in alone[1:]]
        assert first.consume().token_ids == alone[0].token_ids
    return log


def test_a_running_stream_waits_for_one_prefill_at_a_time(tokenizer, monkeypatch):
    log = _late_while_running(_engine("llama", tokenizer), monkeypatch, "one")
    prefills = [i for i, (_, rows, n) in enumerate(log) if n]
    assert sum(log[i][2] for i in prefills) == 4 and all(log[i][2] == 1 for i in prefills)
    for a, b in zip(prefills[1:], prefills[2:]):  # the running rows step between two prefills, or ride in them
        assert log[b][1] or any(kind == "step" for kind, _, _ in log[a + 1 : b]), log


def test_by_default_every_waiting_prefill_runs_before_the_next_step(tokenizer, monkeypatch):
    pc = _engine("llama", tokenizer)
    with pc.scheduler(max_batch=2) as s:
        assert s.admission == batcher_module.DEFAULT_ADMISSION == "all"
    log = _late_while_running(pc, monkeypatch, "all")
    assert all(kind != "mixed" for kind, _, _ in log), log
    prefills = [i for i, (kind, _, _) in enumerate(log) if kind == "prefill"]
    assert len(prefills) == 4 and prefills[1:] == list(range(prefills[1], prefills[1] + 3)), log  # back to back


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefills_waiting_with_no_row_running_run_in_one_forward(tokenizer, monkeypatch, arch):
    pc = _engine(arch, tokenizer)
    alone = [pc.generate(p, max_new_tokens=n, ignore_eos=True) for p, n in LATE]
    log = _logged(monkeypatch)
    armed, gate = _gate(monkeypatch)
    armed.set()
    paced = []  # what the engine's cost model hears of the prefills it ran (its pace, costmodel.py)
    monkeypatch.setattr(pc.fallback, "ran", lambda new, context, seconds, rows: paced.append((new, context, seconds)))
    with Batcher(pc, max_batch=4, admission="one") as s:
        handles = [s.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in LATE]
        gate.set()
        assert [h.consume().token_ids for h in handles] == [a.token_ids for a in alone]
    # each prefill is heard once, with its new tokens and what they attended to, whether alone or shared
    plans = [pc.plan(p) for p, _ in LATE]
    assert [(n, c) for n, c, _ in paced] == [(p.num_tokens - p.num_cached, p.num_cached) for p in plans], (paced, log)
    assert all(seconds >= 0 for _, _, seconds in paced)
    if arch == "llama":
        assert log[0] == ("mixed", 0, 3), log
    else:  # no lean forward: one whole prefill, then the rows step, before the next
        assert all(kind != "mixed" for kind, _, _ in log), log
        prefills = [i for i, (kind, _, _) in enumerate(log) if kind == "prefill"]
        assert len(prefills) == 3 and all(b > a + 1 for a, b in zip(prefills, prefills[1:])), log


def test_admission_names_its_options(tokenizer):
    pc = _engine("llama", tokenizer)
    with pytest.raises(ValueError, match="valid: all, one"):
        Batcher(pc, admission="each")
    with pytest.raises(ValueError, match="prefill_chunk=None"):
        Batcher(pc, admission="one", prefill_chunk=4)


def test_a_repeat_waiting_with_new_prefills_joins_at_once_and_rides_in_their_forward(tokenizer, monkeypatch):
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.store import MemoryStore
    from tests.test_prefix_cache import CHAT_SCHEMA, chat

    prompts = [chat(["a"], [("user", "Where?")]), chat(["b", "c"], [("user", "And Fuji?")]),
               chat(["c", "a"], [("user", "Why so?")])]
    pc = _engine("llama", tokenizer)
    # the same weights with a prefix cache: the second prompt, asked before, is an exact repeat there
    on = PromptCache(pc.model, tokenizer, store=MemoryStore(), recovery="none", fallback="never")
    for engine in (pc, on):
        engine.add_schema(CHAT_SCHEMA)
    alone = [pc.generate(p, max_new_tokens=5, ignore_eos=True) for p in prompts]
    assert on.generate(prompts[1], max_new_tokens=5, ignore_eos=True).token_ids == alone[1].token_ids
    log = _logged(monkeypatch)
    armed, gate = _gate(monkeypatch)
    armed.set()
    with Batcher(on, max_batch=4, admission="one") as s:
        handles = [s.submit(p, max_new_tokens=5, ignore_eos=True) for p in prompts]
        gate.set()
        assert [h.consume().token_ids for h in handles] == [a.token_ids for a in alone]
    assert on.prefix_cache.num_repeats == 1
    assert log[0] == ("mixed", 1, 2), log  # the repeat decodes its second token beside the two prefills
