"""Never slower than not caching (engine/planning/costmodel.py, issue 26 §4): with this machine's costs, a plan
that recomputes almost everything runs as a plain full prefill (its answer is `use_cache=False`'s), a
plan with most tokens cached stays cached, the policy can force either, and the costs are measured once
and stored under the cache home."""

from __future__ import annotations

import json
import os

import pytest

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.planning import costmodel
from rag_promptcache.engine.planning.costmodel import Costs, Fallback, FixedPace, stored_costs
from rag_promptcache.model.positions import kv_geometry, relocator_for
from rag_promptcache.store import MemoryStore
from tests.test_recovery import PROMPT, SCHEMA
from tests.tiny import build

# a forward costs 1 ms plus 0.1 ms a token; assembling costs 2 ms plus 1 us a cached token
COSTS = Costs(fixed_s=1e-3, token_s=1e-4, pair_s=0.0, cached_token_s=1e-6, cached_fixed_s=2e-3)


def engine(tokenizer, fallback) -> PromptCache:
    pc = PromptCache(build("llama", vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery="none",
                     fallback=fallback)
    pc.add_schema(SCHEMA)
    return pc


def test_auto_runs_full_prefill_where_recovery_recomputes_almost_everything(tokenizer):
    pc = engine(tokenizer, Fallback("auto", lambda: COSTS, pace=FixedPace()))  # COSTS are the machine, whatever it runs
    full = pc.generate(PROMPT, use_cache=False, max_new_tokens=6, ignore_eos=True)
    assert full.path == "full" and full.cached_tokens == 0
    pc.generate(PROMPT, max_new_tokens=1)  # every module stored
    # first_k:1000 recomputes every cached token but the opening root text
    most = pc.plan(PROMPT, recovery="first_k:1000", fallback=False)
    assert most.path == "cached" and 0 < most.num_cached < most.num_tokens / 3
    res = pc.generate(PROMPT, recovery="first_k:1000", max_new_tokens=6, ignore_eos=True)
    assert res.path == "full" and res.cached_tokens == 0 and res.computed_tokens == res.prompt_tokens
    assert res.token_ids == full.token_ids  # it is full prefill: the same answer
    cached = pc.generate(PROMPT, max_new_tokens=6, ignore_eos=True)  # recovery none: nearly all from the store
    assert cached.path == "cached" and cached.cached_tokens > cached.prompt_tokens / 2
    assert pc.compare(PROMPT, recovery="first_k:1000").cached_tokens > 0  # compare always assembles


def test_policies_force_either_path_and_bad_ones_are_refused(tokenizer, monkeypatch):
    assert engine(tokenizer, "never").generate(PROMPT, recovery="first_k:1000", max_new_tokens=1).path == "cached"
    assert engine(tokenizer, "always").generate(PROMPT, max_new_tokens=1).path == "full"
    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "always")
    assert engine(tokenizer, None).fallback.policy == "always"
    monkeypatch.setenv("RAG_PROMPTCACHE_FALLBACK", "sometimes")
    with pytest.raises(ValueError, match=r"RAG_PROMPTCACHE_FALLBACK 'sometimes'; valid: auto, never, always"):
        engine(tokenizer, None)
    with pytest.raises(ValueError, match="unknown fallback 'fast'; valid: auto, never, always"):
        engine(tokenizer, "fast")


def test_a_calibration_that_sees_no_token_cost_keeps_the_cached_plan():
    flat = Fallback("auto", lambda: Costs(1.0, 0.0, 0.0, 0.0, 0.0))
    assert not flat.use_full(1000, 10)
    assert Fallback("auto", lambda: COSTS).use_full(100, 0)  # nothing cached: nothing to assemble


def test_costs_are_measured_once_and_stored(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_PROMPTCACHE_COSTS_DIR", str(tmp_path / "costs"))
    monkeypatch.setattr(costmodel, "cpu_busy", lambda: False)  # the machine's load, held still
    model = build("llama", vocab_size=len(tokenizer))
    args = (model, relocator_for(model), kv_geometry(model), "fp-test")
    first = stored_costs(*args)
    assert first.token_s >= 0 and first.fixed_s >= 0 and len(list((tmp_path / "costs").glob("*.json"))) == 1

    def refuse(*_a, **_k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(costmodel, "calibrate", refuse)
    assert stored_costs(*args) == first


def test_a_full_path_follow_up_reuses_an_earlier_full_path_prefix_exactly(tokenizer):
    """Full-path plans label every token as computed, so the prefix cache serves one from another (and
    never from a cached-path plan, whose module tokens carry store keys)."""
    pc = engine(tokenizer, "always")
    pc.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    again = pc.generate(PROMPT, max_new_tokens=4, ignore_eos=True)
    assert again.path == "full" and again.num_prefix_tokens >= again.prompt_tokens - 1
    off = PromptCache(pc.model, pc.tokenizer, store=MemoryStore(), recovery="none", fallback="always",
                      prefix_cache_bytes=0)
    off.add_schema(SCHEMA)
    assert off.generate(PROMPT, max_new_tokens=4, ignore_eos=True).token_ids == again.token_ids
    cached = PromptCache(pc.model, pc.tokenizer, store=pc.store, recovery="none", fallback="never")
    cached.add_schema(SCHEMA)
    cached.prefix_cache = pc.prefix_cache  # one tree, the same model: only the labels keep them apart
    assert cached.prefix_namespace == pc.prefix_namespace
    assert cached.generate(PROMPT, max_new_tokens=1).num_prefix_tokens < cached.plan(PROMPT).num_tokens / 2


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_learned_absolute_positions_calibrate_and_answer_on_the_defaults(arch, tokenizer, tmp_path, monkeypatch):
    """A new user's first cached request on a GPT-2 or OPT model, every setting left at its default: the
    calibration (here from scratch) must not relocate keys such a model cannot move."""
    monkeypatch.setenv("RAG_PROMPTCACHE_COSTS_DIR", str(tmp_path / "costs"))
    monkeypatch.delenv("RAG_PROMPTCACHE_FALLBACK", raising=False)
    pc = PromptCache(build(arch, vocab_size=len(tokenizer)), tokenizer)
    pc.add_schema('<schema name="facts"><module name="a">The sky is blue and the grass is green.</module></schema>')
    res = pc.generate('<prompt schema="facts"><a/> go</prompt>', max_new_tokens=3, ignore_eos=True)
    assert pc.fallback.policy == "auto" and pc.fallback.costs is not None and len(res.token_ids) == 3
    assert res.path in ("cached", "full")


def test_a_calibration_stored_while_the_cpu_was_busy_is_measured_again_once_it_is_idle(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_PROMPTCACHE_COSTS_DIR", str(tmp_path / "costs"))
    model = build("llama", vocab_size=len(tokenizer))
    args = (model, relocator_for(model), kv_geometry(model), "fp-busy")
    calls = []
    real = costmodel.calibrate
    monkeypatch.setattr(costmodel, "calibrate", lambda *a, **k: calls.append(1) or real(*a, **k))
    busy = [True]
    monkeypatch.setattr(costmodel, "cpu_busy", lambda: busy[0])
    stored_costs(*args)
    (saved,) = (tmp_path / "costs").glob("*.json")
    assert json.loads(saved.read_text())["cpu_busy"] is True and len(calls) == 1
    stored_costs(*args)  # still busy: kept, no calibration storm under load
    assert len(calls) == 1
    busy[0] = False
    stored_costs(*args)  # idle now: measured again, and stored as idle
    assert len(calls) == 2 and json.loads(saved.read_text())["cpu_busy"] is False
    busy[0] = True
    stored_costs(*args)  # an idle calibration stays, whatever the load later
    assert len(calls) == 2


def test_busy_means_load_over_one_and_a_half_times_the_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5 * cores + 0.1, 0.0, 0.0))
    assert costmodel.cpu_busy()
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0 * cores, 0.0, 0.0))
    assert not costmodel.cpu_busy()

    def unreadable():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", unreadable)
    assert not costmodel.cpu_busy()
