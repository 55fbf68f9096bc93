"""Contract test for position relocation: keys encoded at p and rotated by d must equal the keys the
model itself writes at p + d. Tiny random-weight models, fp32, no downloads. Adding an
architecture is one line in ARCHS."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from rag_promptcache.model.positions import UnsupportedModelError, kv_geometry, relocator_for

from tests.tiny import ARCHS, build, cfg

TOL = 1e-4
START, NUM_TOKENS = 40, 12
ROPE_ARCHS = [a for a in ARCHS if a not in ("gpt2", "opt")]  # learned absolute: tested below


@torch.no_grad()
def encode(model, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cache = DynamicCache(config=model.config)
    model(ids[None], position_ids=positions[None], past_key_values=cache, use_cache=True)
    # per layer [B, H, S, D] -> [L, H, S, D]
    keys = torch.stack([layer.keys[0] for layer in cache.layers])
    values = torch.stack([layer.values[0] for layer in cache.layers])
    return keys, values


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", ROPE_ARCHS)
def test_rotate_matches_model_at_new_position(name, device):
    model = build(name, device)
    reloc = relocator_for(model)
    assert reloc.relocatable and reloc.kind in ("rope", "alibi"), f"{reloc=}"
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (NUM_TOKENS,)).to(device)
    base = torch.arange(START, START + NUM_TOKENS, device=device)
    keys, values = encode(model, ids, base)
    geo = kv_geometry(model)
    assert keys.shape == (geo.num_layers, geo.num_kv_heads, NUM_TOKENS, geo.head_dim), f"{keys.shape=} {geo=}"
    cache_kinds = [type(layer).__name__ for layer in DynamicCache(config=model.config).layers]
    assert [t == "sliding_attention" for t in geo.layer_types] == ["Sliding" in k for k in cache_kinds], f"{geo=}"

    for delta in (37, 500, -START):
        deltas = torch.full((NUM_TOKENS,), delta, device=device)
        moved_keys, moved_values = encode(model, ids, base + deltas)
        if reloc.exact_below is not None:
            assert int((base + deltas).max()) < reloc.exact_below
        err = max_err(reloc.rotate(keys, deltas), moved_keys)
        assert err <= TOL, f"{name} {delta=} {err=}"
        assert max_err(values, moved_values) <= 1e-5, f"values moved with position: {name} {delta=}"
        assert torch.equal(values[0], moved_values[0])
        if reloc.kind == "rope" and delta:
            assert max_err(keys, moved_keys) > 10 * TOL, "keys did not depend on position: test is vacuous"

    # Per-token deltas: a token's layer-0 key depends only on its own position, so compare layer 0 with
    # the model, and every layer with the uniform rotations chosen per token.
    torch.manual_seed(2)
    deltas = torch.randint(-START, 600, (NUM_TOKENS,)).to(device)
    rotated = reloc.rotate(keys, deltas)
    moved_keys, _ = encode(model, ids, base + deltas)
    assert max_err(rotated[0], moved_keys[0]) <= TOL, f"{name} per-token layer 0"
    for i, d in enumerate(deltas.tolist()):
        uniform = reloc.rotate(keys, torch.full((NUM_TOKENS,), d, device=device))
        assert max_err(rotated[:, :, i], uniform[:, :, i]) <= 1e-6, f"{name} per-token {i=}"


@pytest.mark.parametrize("name", ["gpt2", "opt", "gpt_neo"])
def test_learned_absolute_positions_are_not_relocatable(name):
    config = {
        "gpt2": lambda: cfg("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=128),
        "opt": lambda: cfg("opt", ffn_dim=128, word_embed_proj_dim=64),
        "gpt_neo": lambda: cfg("gpt_neo", num_layers=2, attention_types=[[["global"], 2]], num_heads=4),
    }[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    reloc = relocator_for(model)
    assert (reloc.kind, reloc.relocatable) == ("absolute", False)
    keys, _ = encode(model, torch.arange(5), torch.arange(5))
    assert reloc.rotate(keys, torch.zeros(5, dtype=torch.int64)) is keys
    with pytest.raises(ValueError, match="absolute"):
        reloc.rotate(keys, torch.tensor([0, 0, 1, 0, 0]))


def test_alibi_rotate_is_identity():
    reloc = relocator_for(build("bloom_alibi"))
    keys = torch.randn(2, 4, 5, 16)
    assert reloc.rotate(keys, torch.arange(5) - 2) is keys


def test_unknown_model_type_is_refused():
    model = AutoModelForCausalLM.from_config(cfg("xglm", d_model=64, num_layers=2, attention_heads=4, ffn_dim=128))
    with pytest.raises(UnsupportedModelError, match=r"'xglm'.*supported: \[.*'llama'"):
        relocator_for(model)


def test_length_dependent_rope_reports_exact_bound():
    assert relocator_for(build("llama_dynamic")).exact_below == 2047
    assert relocator_for(build("llama_longrope")).exact_below == 1024
    yarn = build("llama_yarn")
    assert relocator_for(yarn).exact_below is None
    # yarn scales cos/sin in the model; the contract test passing means rotate does not scale again
    assert yarn.model.rotary_emb.attention_scaling > 1.1


def test_rotate_preserves_bf16_and_input():
    reloc = relocator_for(build("gemma3_text"))
    keys = torch.randn(2, 2, 7, 16, dtype=torch.bfloat16)
    before = keys.clone()
    out = reloc.rotate(keys, torch.arange(7) * 3)
    assert out.dtype == torch.bfloat16 and out.shape == keys.shape
    assert torch.equal(keys, before)
    assert torch.equal(reloc.rotate(keys, torch.zeros(7, dtype=torch.int64)), keys)
