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
from rag_promptcache.tune.probe import greedy
from tests.tiny import build
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


def test_a_module_reads_its_neighbours_layout_only_where_enough_of_them_are_in_the_prompt(tiny):
    """`present`: as `ingest --neighbours-present C` serves it, a module is laid out after its neighbours only
    where C of them are among the prompt's modules, on its own otherwise (`compiler.read_as`)."""
    _, tok = tiny
    layouter = Layouter(tok)
    near = [[MODULES[2], MODULES[1]], [], [MODULES[0]]]  # m0 after m2 and m1 (both here), m2 after m0 (one)

    def lay(modules, neighbours, present=0):
        return layouter.lay(INSTRUCTIONS, modules, "When did the Ferro bridge open?", "In 1877.", neighbours, present)

    def shape(laid):
        return laid.ids, laid.hidden, laid.pos

    both = lay(MODULES, near, present=2)
    assert shape(both) == shape(lay(MODULES, [near[0], [], []]))
    one = lay(MODULES, near, present=1)
    assert shape(one) == shape(lay(MODULES, near))
    assert sum(one.hidden) > sum(both.hidden) > 0
    two = lay(MODULES[:2], near[:2], present=2)  # m0's m2 is not in this prompt: m0 reads its own encoding
    assert two.ids == lay(MODULES[:2], ()).ids and not any(two.hidden or ())


@pytest.mark.parametrize("mode", ["shared_prefix", "isolated"])
def test_modules_encoded_after_their_neighbours_are_laid_out_as_the_engine_reads_them(tiny, mode):
    """A module encoded after its neighbours (a corpus ingested with `--neighbours M`) is laid out behind a
    hidden copy of what its encoding read: the masked forward gives the engine's cached plan's logits."""
    model, tok = tiny
    question = "When did the Ferro bridge open?"
    near = [[MODULES[2], MODULES[1]], [], [MODULES[0]]]  # m1 encoded on its own; m0 after two, m2 after one
    laid = Layouter(tok, mode).lay(INSTRUCTIONS, MODULES, question, "In 1877.", neighbours=near)
    # the neighbours' tokens, and in shared_prefix mode the shared prefix once more, for each of m0 and m2
    assert laid.hidden is not None and sum(laid.hidden) >= sum(len(tok.encode(t)) for t in (MODULES[2], MODULES[1], MODULES[0]))
    engine = PromptCache(model, tok, mode=mode, recovery="none", fallback="never", prefix_cache_bytes=0)
    names = [f"m{i}" for i in range(len(MODULES))]
    extra = {"x0": MODULES[2], "x1": MODULES[1], "x2": MODULES[0]}
    mods = {n: ast.Module(n, (ast.Text(t),)) for n, t in (*zip(names, MODULES), *extra.items())}
    laid_schema = ast.Schema(SCHEMA, (ast.Role("system", (ast.Text(INSTRUCTIONS + "\n\n"), *mods.values())),),
                             modules=mods, parents={n: None for n in mods}, union_of={},
                             neighbours={"m0": ("x0", "x1"), "m2": ("x2",)})
    engine.add_schema(laid_schema)
    plan = engine.plan(prompt_pml(SCHEMA, names, [("user", question)]), recovery="none")
    shown = [t for t, h in zip(laid.ids, laid.hidden) if not h]
    assert [t for p in plan.pieces for t in p.token_ids] == shown[:laid.plain().answer_from]
    got = engine.prefill(plan).logits
    ids, pos, mask = batch_masks([laid], [False])
    n = laid.answer_from
    with torch.no_grad():
        want = model(ids[:, :n], position_ids=pos[:, :n], attention_mask=mask[:, :, :n, :n]).logits[0, -1]
        alone = Layouter(tok, mode).lay(INSTRUCTIONS, MODULES, question, "In 1877.")  # every module on its own
        a_ids, a_pos, a_mask = batch_masks([alone], [False])
        m = alone.answer_from
        plain = model(a_ids[:, :m], position_ids=a_pos[:, :m], attention_mask=a_mask[:, :, :m, :m]).logits[0, -1]
    err = (got - want).abs().max().item()
    assert err < 1e-3, err
    assert (got - plain).abs().max().item() > 20 * err, "the neighbours must change what the question reads"
    # a full prefill (the teacher) reads the prompt without the copies, at positions 0, 1, ...
    assert laid.plain().ids == alone.plain().ids and laid.plain().answer_from == alone.answer_from
    # the probe's greedy answers (tune/probe.py) continue from the module positions, past the copies
    varied = build("llama", vocab_size=len(tok))  # random weights whose greedy answers vary token to token
    engine = PromptCache(varied, tok, mode=mode, recovery="none", fallback="never", prefix_cache_bytes=0)
    engine.add_schema(laid_schema)
    tokens = greedy(varied, [laid, alone], full=False, max_new_tokens=8, eos_ids=[-1])
    reference = engine.generate(prompt_pml(SCHEMA, names, [("user", question)]), max_new_tokens=8, recovery="none")
    assert tokens[0] == list(reference.token_ids) and len(set(tokens[0])) > 2, (tokens, reference.token_ids)
    assert tokens[0] != tokens[1], "the neighbours change the answer"
