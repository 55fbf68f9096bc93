"""Tuning trains what the engine runs: a masked forward over a sample laid out by `tune.layout`
gives the logits the engine's cached plan (recovery `none`) gives for the same prompt."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rag_promptcache.engine import PromptCache
from rag_promptcache.pml import ast
from rag_promptcache.pml.build import prompt_pml
from rag_promptcache.tune.layout import SCHEMA, Layouter, batch_masks, block_mask
from tests.tiny_llama import save_tiny_llama

INSTRUCTIONS = "Answer from the documents below."
MODULES = ["[a.md]\nThe Kettle bridge opened in 1802 and has nine arches.\n\n",
           "[b.md]\nThe Ferro bridge opened in 1877; it has four arches and a toll house.\n\n",
           "[c.md]\nThe Lamb bridge opened in 1931.\n\n"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_llama(tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("mode", ["shared_prefix", "isolated"])
def test_masked_forward_equals_the_engines_cached_plan(tiny, mode):
    model, tok = tiny
    laid = Layouter(tok, mode).lay(INSTRUCTIONS, MODULES, "When did the Ferro bridge open?", "In 1877.")
    engine = PromptCache(model, tok, mode=mode, recovery="none", fallback="never", prefix_cache_bytes=0)
    names = [f"m{i}" for i in range(len(MODULES))]
    mods = {n: ast.Module(n, (ast.Text(t),)) for n, t in zip(names, MODULES)}
    engine.add_schema(ast.Schema(SCHEMA, (ast.Role("system", (ast.Text(INSTRUCTIONS + "\n\n"), *mods.values())),),
                                 modules=mods, parents={n: None for n in names}, union_of={}))
    plan = engine.plan(prompt_pml(SCHEMA, names, [("user", "When did the Ferro bridge open?")]), recovery="none")
    assert [t for p in plan.pieces for t in p.token_ids] == laid.ids[:laid.answer_from]
    assert plan.num_cached > 0 and plan.num_cached == sum(u >= 0 for u in laid.unit)
    got = engine.prefill(plan).logits
    ids, pos, mask = batch_masks([laid], [False])
    n = laid.answer_from
    with torch.no_grad():
        want = model(ids[:, :n], position_ids=pos[:, :n], attention_mask=mask[:, :, :n, :n]).logits[0, -1]
        causal = model(ids[:, :n]).logits[0, -1]
    err = (got - want).abs().max().item()
    assert err < 1e-3, err  # relocation's rounding (DESIGN.md: ~1e-4 on keys)
    assert (got - causal).abs().max().item() > 20 * err, "the block mask must differ from full attention"


def test_block_mask_shape(tiny):
    _, tok = tiny
    laid = Layouter(tok).lay(INSTRUCTIONS, MODULES, "Which bridge is oldest?", "Kettle.")
    m = block_mask(laid)
    first = [laid.unit.index(u) for u in sorted(set(laid.unit) - {-1})]
    prefix = laid.context[first[1]]  # first[0] is the root (the system turn), first[1] the first module
    assert prefix > 0 and laid.unit[laid.loss_from] == -1 and laid.unit[laid.loss_from - 1] != -1
    # the second module sees the shared prefix and itself, not the first module
    assert m[first[2], :prefix].all() and not m[first[2], first[1]:first[2]].any() and m[first[2], first[2]]
    # new tokens see everything before them
    assert m[laid.loss_from, : laid.loss_from + 1].all()
    with pytest.raises(ValueError, match="valid: shared_prefix, isolated"):
        Layouter(tok, "nope")
