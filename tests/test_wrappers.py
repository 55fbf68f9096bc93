"""Wrapper tokens (KV Packet; model/links.py): learned tokens before and after every module, part of the
module's own tokens, so they are encoded and stored with it; training reads the same layout under the
block mask."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rag_promptcache.engine import PromptCache
from rag_promptcache.model import adapter as adapters
from rag_promptcache.model import links
from rag_promptcache.store import MemoryStore
from rag_promptcache.tune.layout import Layouter, batch_masks
from tests.test_links import INSTRUCTIONS, MODULES, NAMES, QUESTION, tiny_dir  # noqa: F401 - a fixture
from tests.test_links import _engine as links_engine, _prompt

WRAP = 2  # a side


@pytest.fixture()
def tiny(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    links.install(model, links.fresh(model, 2 * WRAP + 3, seed=1), WRAP)  # 2 wrappers a side, then 3 links
    return model, AutoTokenizer.from_pretrained(tiny_dir)


def _engine(model, tok, mode="shared_prefix", **kwargs) -> PromptCache:
    return links_engine(model, tok, mode, store=MemoryStore(), **kwargs)


def test_the_table_keeps_wrappers_before_links(tiny):
    model, _ = tiny
    opening, closing = links.wrap_ids(model)
    first = links.of(model).first_id
    assert opening == (first, first + 1) and closing == (first + 2, first + 3)
    assert links.ids(model, 3) == (first + 4, first + 5, first + 6) and links.of(model).num_links == 3
    with pytest.raises(ValueError, match="only 3 trained link tokens"):
        links.ids(model, 4)
    with pytest.raises(ValueError, match="3 wrapper tokens a side need 6 rows"):
        links.install(model, links.fresh(model, 5), 3)


@pytest.mark.parametrize("mode", ["shared_prefix", "isolated"])
def test_modules_are_stored_wrapped_and_equal_the_masked_training_forward(tiny, mode):
    model, tok = tiny
    opening, closing = links.wrap_ids(model)
    laid = Layouter(tok, mode, wrap=(opening, closing)).lay(INSTRUCTIONS, MODULES, QUESTION, "In 1877.")
    engine = _engine(model, tok, mode, recovery="none", prefix_cache_bytes=0)
    plan = engine.plan(_prompt())
    assert [t for p in plan.pieces for t in p.token_ids] == laid.ids[:laid.answer_from]
    for name in NAMES:  # each module's stored KV holds its wrappers
        kv = plan.kvs[name]
        assert kv.token_ids[:WRAP] == opening and kv.token_ids[-WRAP:] == closing
    assert laid.num_links == 2 * WRAP * len(MODULES) and laid.plain().ids == [
        t for t in laid.ids if t < links.of(model).first_id]
    got = engine.prefill(plan).logits
    batch, pos, mask = batch_masks([laid], [False])
    n = laid.answer_from
    with torch.no_grad():
        want = model(batch[:, :n], position_ids=pos[:, :n], attention_mask=mask[:, :, :n, :n]).logits[0, -1]
        causal = model(batch[:, :n], position_ids=pos[:, :n]).logits[0, -1]  # modules that saw each other
    err = (got - want).abs().max().item()
    assert err < 1e-3, err  # fp32 rounding of relocated keys
    assert (got - causal).abs().max().item() > 20 * err, "the block mask must be what the engine computes"
    # the same prompt with recovery: the wrappers are module tokens like the others
    assert engine.generate(_prompt(), recovery="last:1", max_new_tokens=3).finish_reason in ("length", "stop")


def test_an_adapter_with_wrappers_is_read_and_a_plain_model_compiles_no_wrappers(tiny_dir, tmp_path):
    from rag_promptcache.model.loading import load_model
    from tests.tiny_adapter import save_random_lora

    wrapped = save_random_lora(tiny_dir, tmp_path / "wrapped")
    base, tok = load_model(tiny_dir, device="cpu", dtype="float32", adapter="none")
    links.save(links.fresh(base, 2 * WRAP), wrapped, WRAP)
    record = adapters.read(wrapped)
    assert (record.num_wrap, record.num_links) == (WRAP, 0)
    model, _ = load_model(tiny_dir, device="cpu", dtype="float32", adapter=str(wrapped))
    assert links.wrap_ids(model)[0] and links.of(model).num_links == 0
    tokens = _engine(model, tok).plan(_prompt()).kvs["m0"].token_ids
    plain = _engine(base, tok).plan(_prompt()).kvs["m0"].token_ids
    assert tokens == links.wrap_ids(model)[0] + plain + links.wrap_ids(model)[1]
    assert links.wrap_ids(base) == ((), ())
