"""Models with sliding-window layers over prompts several windows long (issue 43, 3.10): Gemma 3's mix
of sliding and full layers, Mistral's window on every layer, Qwen2's on the upper layers, each with a
16-token window (tests/tiny.py's `*_window`), against transformers' own forward and cache.

A module at its own position is exact; recomputing everything is full prefill, token for token through
decoding; tokens recomputed before cached ones see their window (assembly's mask per layer type) and
so does every token decoded after them; every recovery runs or is refused by name; prompt lookup's
drafts stay greedy decoding; `eval` reports a setting that fails instead of exiting."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from test_cli import run
from test_eval_decides import FidelityEngine, QUESTIONS
from test_rag_corpus import FakeEmbedder, write_docs
from transformers import DynamicCache

from rag_promptcache.engine import PromptCache, Sampling
from rag_promptcache.engine.compute.runner import cache_arg
from rag_promptcache.engine.kv.assemble import release
from rag_promptcache.engine.planning.prefill import start
from rag_promptcache.engine.planning.recovery import split
from rag_promptcache.rag import corpus as corpus_mod
from rag_promptcache.store import MemoryStore
from tests.tiny import WINDOW, build

ARCHS = ["gemma3_window", "mistral_window", "qwen2_window"]
TOL = 1e-4  # fp32: the same sums in another order
NEW = 8  # tokens decoded

# four modules of about 48 tokens each: three windows apiece, a prompt of about 12
SCHEMA = '<schema name="s">' + "".join(
    f'<module name="m{i}">' + " ".join(f"fact{i}_{j} is {7 * j + i}" for j in range(6)) + "</module>"
    for i in range(4)) + "</schema>"
ONE = '<prompt schema="s"><m0/> What is fact0_3?</prompt>'
ALL = '<prompt schema="s"><m0/><m1/><m2/><m3/> What is fact2_3?</prompt>'


def _engine(arch: str, tokenizer, recovery: str = "none") -> PromptCache:
    pc = PromptCache(build(arch, vocab_size=len(tokenizer)), tokenizer, store=MemoryStore(), recovery=recovery,
                     fallback="never", prefix_cache_bytes=0)
    pc.add_schema(SCHEMA)
    return pc


@torch.inference_mode()
def _reference(model, ids: list[int], num_new: int) -> tuple[torch.Tensor, list[int]]:
    """transformers alone (its own cache, sliding layers keeping their last window): the prompt's last
    logits [V] and `num_new` greedy tokens."""
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([ids]), use_cache=True, **cache_arg(model, cache)).logits[0, -1].float()
    first, tokens = logits, []
    for _ in range(num_new):
        tokens.append(int(logits.argmax()))
        logits = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True,
                       **cache_arg(model, cache)).logits[0, -1].float()
    return first, tokens


def _tokens(plan) -> list[int]:
    positions = [p.position + i for p in plan.pieces for i in range(len(p.token_ids))]
    assert positions == list(range(len(positions))), "contiguous layout: transformers' positions are the same"
    return [t for p in plan.pieces for t in p.token_ids]


def _greedy(pc: PromptCache, prompt: str, **kwargs) -> list[int]:
    return list(pc.generate(prompt, max_new_tokens=NEW, ignore_eos=True, **kwargs).token_ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_module_at_its_own_position_is_exact(arch, tokenizer):
    pc = _engine(arch, tokenizer)
    plan = pc.plan(ONE)
    assert plan.num_cached > 2 * WINDOW, f"{plan.num_cached=}: the module must span several windows"
    first, tokens = _reference(pc.model, _tokens(plan), NEW)
    got = pc.prefill(plan)
    release(got.cache)
    assert float((got.logits - first).abs().max()) <= TOL
    assert _greedy(pc, ONE) == tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_recomputing_everything_is_full_prefill(arch, tokenizer):
    pc = _engine(arch, tokenizer, "selective:1.0")
    plan = pc.plan(ALL)
    assert plan.num_tokens > 10 * WINDOW and plan.num_cached <= len(plan.pieces[0].token_ids)  # at most m0, exact
    first, tokens = _reference(pc.model, _tokens(plan), NEW)
    assert pc.compare(ALL).max_abs_logit_diff <= TOL
    got = pc.prefill(plan)
    release(got.cache)
    assert float((got.logits - first).abs().max()) <= TOL
    assert _greedy(pc, ALL) == tokens == _greedy(pc, ALL, use_cache=False)


@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_recomputed_before_cached_ones_see_their_window(arch, tokenizer):
    """Every third token of an exact module recomputed: new tokens before cached ones, so assembly's
    mask decides what each sees (per layer type where layers mix); the KV is exact either way, so the
    logits, a chunked prefill's logits and the decoded tokens (after the sliding layers are put back in
    sequence order) are transformers' own."""
    pc = _engine(arch, tokenizer)
    plan = pc.plan(ONE)
    module = len(plan.pieces[0].token_ids)
    masked = dataclasses.replace(plan, pieces=split(plan.pieces, set(range(1, module, 3))))
    first, tokens = _reference(pc.model, _tokens(plan), NEW)
    todo = start(pc.model, masked, pc.relocator, pc.geometry)
    mixed = len(set(pc.geometry.layer_types)) > 1
    assert isinstance(todo.asm.mask, dict) == mixed and todo.asm.mask is not None
    whole = todo.run(pc.model)
    assert float((whole.logits - first).abs().max()) <= TOL
    release(whole.cache)
    chunked = start(pc.model, masked, pc.relocator, pc.geometry)
    while (done := chunked.run(pc.model, 7)) is None:
        pass
    assert float((done.logits - first).abs().max()) <= TOL
    release(done.cache)
    sampling = Sampling(max_new_tokens=NEW, ignore_eos=True)
    assert list(pc.stream_plan(masked, sampling).consume().token_ids) == tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_every_recovery_runs_or_is_refused_by_name(arch, tokenizer):
    pc = _engine(arch, tokenizer)
    depth = pc.model.config.num_hidden_layers
    for recovery in ("none", "first_k:2", "selective:0.2", "last:1", "last:2", "attend:1@1", "question:0.1@1"):
        res = pc.generate(ALL, recovery=recovery, max_new_tokens=3, ignore_eos=True)
        assert len(res.token_ids) == 3, recovery
    for recovery, words in (("attend:1", f"attention layer 8 is past the model's {depth} layers"),
                            ("question:0.1", f"question recovery layer 8 is past the model's {depth} layers")):
        with pytest.raises(ValueError, match=words):
            pc.generate(ALL, recovery=recovery, max_new_tokens=3)


def test_prompt_lookup_drafts_are_greedy_decoding_past_the_window(tokenizer):
    """The reserved cache of a sliding-window model can drop rejected drafts, so prompt lookup runs."""
    model = build("gemma3_window", vocab_size=len(tokenizer))
    answers = {}
    for lookup in (0, 4):
        pc = PromptCache(model, tokenizer, store=MemoryStore(), prompt_lookup=lookup, recovery="first_k:2",
                         fallback="never", prefix_cache_bytes=0)
        pc.add_schema(SCHEMA)
        answers[lookup] = pc.generate(ALL, max_new_tokens=24, ignore_eos=True)
    assert answers[4].token_ids == answers[0].token_ids
    assert answers[4].num_decode_forwards < answers[0].num_decode_forwards == 23  # drafts were accepted


class BrokenSetting(FidelityEngine):
    """`first_k:2` fails inside the model, as `last:1` did on Gemma 3 before assembly knew windows."""

    def generate(self, prompt: str, *, use_cache: bool = True, recovery: str | None = None, **kwargs):
        if use_cache and recovery == "first_k:2":
            raise RuntimeError("The size of tensor a (773) must match the size of tensor b (867) at non-singleton "
                               "dimension 3")
        return super().generate(prompt, use_cache=use_cache, recovery=recovery, **kwargs)


def test_eval_reports_a_setting_that_fails_and_goes_on(tmp_path: Path, monkeypatch, capsys) -> None:
    engine = BrokenSetting()
    monkeypatch.setattr(corpus_mod, "_load_engine", lambda model, store, mode, dtype=None, adapter=None: engine)
    monkeypatch.setattr(corpus_mod, "_load_embedder", lambda name: FakeEmbedder())
    code, _, err = run(capsys, "ingest", write_docs(tmp_path / "docs"), "--corpus", tmp_path / "c",
                       "--chunk-tokens", "32", "--overlap", "8")
    assert code == 0, err
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QUESTIONS))
    args = ("eval", questions, "--corpus", tmp_path / "c", "-k", "1", "--recovery", "none,first_k:2,last:1")
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert re.search(r"first_k:2 +3/3 failed: RuntimeError: The size of tensor a \(773\)", out), out  # full right, then why
    # three right answers are too few to recommend on (rag.fidelity.MIN_TO_RECOMMEND); the run still reports
    # the setting that works after the one that failed
    assert "last:1: every question as full prefill answers it" in out and "recommended:" not in out
    code, out, err = run(capsys, *args, "--verbose")
    assert "first_k:2: failed, no answers: RuntimeError" in out
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    by = {s["recovery"]: s for s in json.loads(out)["settings"]}
    assert by["first_k:2"]["error"].startswith("RuntimeError: The size of tensor a")
    assert by["first_k:2"]["kept"] is None and by["first_k:2"]["speedup"] is None and by["last:1"]["error"] is None
    assert json.loads(out)["recommended"] is None  # too few right answers, as above
