"""Module encoding's batches: units of similar lengths, little padding, and the same KV whatever the
batch (engine/planning/encoder.py)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rag_promptcache.engine.planning.encoder import MAX_PADDING, batches, encode_units
from rag_promptcache.engine.prompt.compiler import Unit


def test_batches_bound_their_padding_and_size() -> None:
    lengths = [33, 40, 41, 199, 200, 210, 212, 240, 250, 251, 251, 252, 253, 254, 255, 256]
    parts = batches(lengths, batch_size=4)
    assert [i for p in parts for i in p] == list(range(len(lengths)))  # every unit once, in order
    for p in parts:
        width, real = max(lengths[i] for i in p), sum(lengths[i] for i in p)
        assert len(p) <= 4 and (len(p) == 1 or len(p) * width - real <= MAX_PADDING * len(p) * width)
    assert parts[0] == [0, 1, 2] and [0, 1, 2, 3] not in parts  # the short ones together, not with 199
    assert batches([], 8) == [] and batches([7], 8) == [[0]]
    assert batches([10, 10, 10], 2) == [[0, 1], [2]]


def test_units_encode_to_the_same_kv_in_any_batch() -> None:
    config = AutoConfig.for_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    context = (1, 5, 9)
    units = [Unit(f"u{i}", tuple(torch.randint(3, 128, (n,), generator=gen).tolist()), (), len(context), context)
             for i, n in enumerate([12, 70, 13, 64, 66, 5, 71])]
    together = encode_units(model, units, mode="shared_prefix", fingerprint="f", batch_size=8)
    alone = [encode_units(model, [u], mode="shared_prefix", fingerprint="f")[0] for u in units]
    for a, b in zip(together, alone):
        assert a.token_ids == b.token_ids and a.start == b.start == len(context)
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)
