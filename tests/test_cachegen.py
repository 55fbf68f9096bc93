"""The cachegen codec (store/cachegen.py): size and error, bad streams, corrupt entries in the tiers
(a miss and a recompute, never a wrong answer), and on SmolLM2's own KV the size and decode-time
targets against int8 and recomputing."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from tests.store_helpers import key_of, make_kv, needs_redis
from tests.test_recovery import PROMPT, SCHEMA
from tests.tiny import build

from rag_promptcache.engine import PromptCache
from rag_promptcache.store import DiskStore, MemoryStore, ModuleKV, NullStore, RedisStore, decode, encode
from rag_promptcache.store import cachegen
from rag_promptcache.store.codecs import CodecError


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tokens", [1, 9, 10, 11, 37])
def test_round_trip_at_group_edges(tokens: int) -> None:
    kv = make_kv(3, num_tokens=tokens, shape=(4, 2, 16))
    got = decode(encode(kv, "cachegen"))
    assert got.keys.shape == kv.keys.shape and got.keys.dtype == kv.keys.dtype
    assert got.token_ids == kv.token_ids and got.start == kv.start
    if tokens > 1:
        assert max(rel_err(got.keys, kv.keys), rel_err(got.values, kv.values)) < 0.45
    # deterministic: the same KV codes to the same bytes
    a, b = encode(kv, "cachegen").tensors, encode(kv, "cachegen").tensors
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_the_sink_at_position_zero_is_kept_and_steps_follow_the_table(monkeypatch) -> None:
    kv = make_kv(1, num_tokens=200, shape=(6, 2, 32))
    at_zero = ModuleKV(kv.keys, kv.values, 0, kv.token_ids, kv.fingerprint, kv.mode)
    got = decode(encode(at_zero, "cachegen"))
    assert torch.allclose(got.keys[:, :, 0], kv.keys[:, :, 0].half().float(), atol=0)  # the sink, in fp16
    assert rel_err(got.keys[:, :, 1:], kv.keys[:, :, 1:]) > 0.01  # the rest, quantized
    monkeypatch.setattr(cachegen, "STEP", ((0.0, 0.25), (0.5, 2.0)))  # fine in the first half, coarse after
    got = decode(encode(kv, "cachegen"))
    err = (got.values - kv.values).pow(2).mean(dim=(1, 2, 3))  # [layers]
    assert err[:3].max() < err[3:].min() / 8


def test_a_step_survives_its_byte() -> None:
    steps = torch.tensor([1e-4, 0.013, 0.7, 3.0, 250.0])
    back = torch.from_numpy(cachegen.step_of(cachegen.step_code(steps).numpy()))
    assert ((back / steps - 1).abs() < 0.05).all()


def test_a_stream_with_words_left_over_or_odd_bytes_is_refused() -> None:
    enc = encode(make_kv(2, num_tokens=30), "cachegen")
    shape = enc.shape
    longer = dict(enc.tensors, stream=torch.cat([enc.tensors["stream"], torch.tensor([1, 2, 3, 4], dtype=torch.uint8)]))
    with pytest.raises(CodecError, match="left after"):
        cachegen.decode(longer, shape, enc.start)
    odd = dict(enc.tensors, stream=enc.tensors["stream"][:-1])
    with pytest.raises(CodecError, match="32-bit words"):
        cachegen.decode(odd, shape, enc.start)


def _flip(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x10
    return bytes(out)


@pytest.mark.parametrize("where", [-5, -300, 100])  # stream tail, inside the payload, the header
def test_flipped_bytes_on_disk_are_a_miss(tmp_path: Path, where: int) -> None:
    store = DiskStore(tmp_path, codec="cachegen")
    kv = make_kv(4, num_tokens=64)
    store.put(key_of(kv), kv)
    path = store.path_for(key_of(kv))
    path.write_bytes(_flip(path.read_bytes(), where))
    assert store.get(key_of(kv)) is None and store.stats().num_errors == 1


@needs_redis
def test_flipped_bytes_in_redis_are_a_miss(redis_server) -> None:
    store = RedisStore(redis_server.url, prefix=uuid.uuid4().hex, codec="cachegen")
    kv = make_kv(5, num_tokens=64)
    store.put(key_of(kv), kv)
    client = store._client  # the test reaches the raw value to damage it
    names = [n for n in client.keys(f"{store.prefix}*") if client.type(n) == b"string"]
    for name in names:
        value = client.get(name)
        if len(value) > 200:
            client.set(name, _flip(value, len(value) - 7))
    assert store.get(key_of(kv)) is None and store.stats().num_errors >= 1
    store.close()


def test_corrupt_entries_are_recomputed_to_the_same_answer(tokenizer, tmp_path: Path) -> None:
    model = build("llama", vocab_size=len(tokenizer))
    fresh = PromptCache(model, tokenizer, store=NullStore(), recovery="none", fallback="never")
    fresh.add_schema(SCHEMA)
    want = fresh.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    pc = PromptCache(model, tokenizer, store=DiskStore(tmp_path, codec="cachegen"), recovery="none",
                     prefix_cache_bytes=0, fallback="never")  # the damaged entries are read, not bypassed
    pc.add_schema(SCHEMA)
    pc.generate(PROMPT, max_new_tokens=1)  # every module stored, coded
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    for f in files:
        f.write_bytes(_flip(f.read_bytes(), len(f.read_bytes()) - 9))
    got = pc.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert got.cached_tokens == 0  # every damaged module was a miss
    assert got.token_ids == want.token_ids


def test_smollm2_kv_a_third_of_int8_and_decoded_faster_than_recomputed(smollm, record_property) -> None:
    model, tok = smollm
    text = " ".join(f"Station {i} records a rainfall of {i * 7 % 31} millimetres in the night." for i in range(30))
    pc = PromptCache(model, tok, store=MemoryStore(), recovery="none", prefix_cache_bytes=0)
    ids = tok(text, add_special_tokens=False)["input_ids"][:256]
    pc.add_schema(f'<schema name="m"><module name="d">{tok.decode(ids)}</module></schema>')
    t0 = time.perf_counter()
    pc.encode("m", ["d"])
    recompute_s = time.perf_counter() - t0
    kv: ModuleKV = pc.store.get(pc.store_keys("m", ["d"])["d"])
    int8 = encode(kv, "int8").num_bytes / kv.num_tokens
    coded = encode(kv, "cachegen")
    per_token = coded.num_bytes / kv.num_tokens
    t0 = time.perf_counter()
    got = decode(coded)
    decode_s = time.perf_counter() - t0
    record_property("cachegen", {"bytes_per_token": per_token, "int8_bytes_per_token": int8,
                                 "decode_s": decode_s, "recompute_s": recompute_s})
    assert per_token * 3 <= int8, (per_token, int8)
    assert decode_s < recompute_s, (decode_s, recompute_s)
    assert np.isfinite(got.keys.numpy()).all() and rel_err(got.keys, kv.keys) < 0.3
