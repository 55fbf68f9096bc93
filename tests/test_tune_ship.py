"""Shipping an adapter (tune/ship.py): float16 weights, the chosen recovery, found as the model's default,
merged to within float16 rounding of the float32 adapter, refused before anything is written when bad."""

from __future__ import annotations

import json

import pytest
import torch

from rag_promptcache.model import adapter as adapters
from rag_promptcache.model.adapter import AdapterError
from rag_promptcache.model.loading import load_model
from rag_promptcache.tune.ship import ship
from tests.tiny_adapter import save_random_lora
from tests.tiny_llama import save_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_a_shipped_adapter_is_the_default_and_merges_as_the_float32_one(tiny, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    lora = save_random_lora(tiny, tmp_path / "trained", recovery="none")
    into = tmp_path / "adapters"
    target = ship(lora, "last:1", model="my-model", measured={"kept": 0.97}, into=into)
    assert target == into / "my-model"
    assert {v.dtype for v in load_file(str(target / "adapter_model.safetensors")).values()} == {torch.float16}
    tune = json.loads((target / "tune.json").read_text())
    assert tune["recovery"] == "last:1" and tune["metrics"]["shipped"] == {"kept": 0.97}
    monkeypatch.setattr(adapters, "SHIPPED", into)
    found = adapters.find("default", "my-model")
    assert found is not None and found.recovery == "last:1" and found.digest != adapters.read(lora).digest
    shipped, tokenizer = load_model(tiny, device="cpu", dtype="float32", adapter=str(target))
    trained, _ = load_model(tiny, device="cpu", dtype="float32", adapter=str(lora))
    base, _ = load_model(tiny, device="cpu", dtype="float32", adapter="none")
    ids = torch.tensor([tokenizer.encode("The zorblat is a purple fruit.")])
    with torch.no_grad():
        a, b, c = shipped(ids).logits, trained(ids).logits, base(ids).logits
    assert (a - b).abs().max() < 0.02 * (b - c).abs().max()


def test_bad_input_writes_nothing(tiny, tmp_path):
    lora = save_random_lora(tiny, tmp_path / "trained")
    into = tmp_path / "adapters"
    with pytest.raises(ValueError, match="recovery"):
        ship(lora, "most:7", model="m", into=into)
    with pytest.raises(AdapterError, match="lacks"):
        ship(tmp_path, "none", model="m", into=into)
    assert not into.exists()


def test_an_adapter_trained_with_links_ships_without_them_when_asked(tiny, tmp_path):
    from rag_promptcache.model import links

    lora = save_random_lora(tiny, tmp_path / "trained")
    base, _ = load_model(tiny, device="cpu", dtype="float32", adapter="none")
    links.save(links.fresh(base, 4, seed=2), lora)
    assert adapters.read(lora).num_links == 4
    with pytest.raises(ValueError, match="links:4.*would have none"):
        ship(lora, "links:4", model="m", into=tmp_path / "refused", with_links=False)
    assert not (tmp_path / "refused").exists()
    target = ship(lora, "last:1", model="m", into=tmp_path / "adapters", with_links=False)
    assert not (target / links.FILE).exists() and adapters.read(target).num_links == 0
    model, _ = load_model(tiny, device="cpu", dtype="float32", adapter=str(target))
    assert links.of(model) is None
    kept = ship(lora, "links:4", model="m", into=tmp_path / "with", with_links=True)
    assert adapters.read(kept).num_links == 4
