"""The engine against full prefill: exactness across architectures, relocation, params, unions,
nesting, fallback to recompute, decoding features. Tiny random-weight models share the SmolLM2
tokenizer; the real SmolLM2 checks text."""

from __future__ import annotations

import asyncio
import copy
import math

import pytest
import torch

from rag_promptcache import PMLError
from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.decoding.text import TextStream
from rag_promptcache.store import MemoryStore
from tests.tiny import build

ENGINE_ARCHS = ["llama", "mistral", "qwen2", "qwen3", "phi3_partial", "gpt_neox_pct25", "gemma2", "gemma3_text"]

FOX = "The quick brown fox jumps over the lazy dog near the river bank."
LONG = " ".join(f"word{i}" for i in range(150))  # pushes later modules far from where they were encoded

SCHEMA = f"""<schema name="s">
  <module name="pad">{LONG}</module>
  <module name="a">{FOX}</module>
  <module name="b">Paris is the capital of France, and the Seine runs through it.</module>
  <module name="trip">Plan a trip for <param name="duration" len="4"/> around the city.</module>
  <union>
    <module name="tokyo">Tokyo has great food.</module>
    <module name="miami">Miami has great beaches.</module>
  </union>
  <module name="outer">Outer text. <module name="inner">Inner text.</module> More outer text.</module>
</schema>"""


def engine(arch: str, tokenizer, device: str = "cpu", **kwargs) -> PromptCache:
    """Raw assembly (no recovery) on the cached path unless a test asks otherwise: these tests look at
    the pieces, so the timed choice of a full prefill (a calibration on a loaded machine) must not
    take them away. The tests that take the `device` fixture run on RAG_PROMPTCACHE_TEST_DEVICE
    (tests/conftest.py)."""
    model = build(arch, device, vocab_size=len(tokenizer))
    pc = PromptCache(model, tokenizer, store=MemoryStore(), **{"recovery": "none", "fallback": "never", **kwargs})
    pc.add_schema(SCHEMA)
    return pc


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_module_at_its_own_position_is_exact(arch, tokenizer, device):
    pc = engine(arch, tokenizer, device)
    cmp = pc.compare('<prompt schema="s"><a/> What jumps?</prompt>')
    assert cmp.cached_tokens > 10
    assert cmp.max_abs_logit_diff <= 1e-4, cmp


@pytest.mark.parametrize("arch", ENGINE_ARCHS)
def test_relocated_module_is_exact(arch, tokenizer, device):
    # schema layout puts `a` after the (not imported) `pad`: its KV, encoded at 0, is rotated by ~300
    # positions; nothing precedes it, so full prefill at the same positions must agree.
    pc = engine(arch, tokenizer, device, layout="schema")
    plan = pc.plan('<prompt schema="s"><a/> What jumps?</prompt>')
    first = plan.pieces[0]
    assert first.unit == "a" and first.position > 300
    cmp = pc.compare('<prompt schema="s"><a/> What jumps?</prompt>')
    assert cmp.max_abs_logit_diff <= 1e-3, cmp


@pytest.mark.parametrize("arch", ["llama", "gpt_neox_pct25"])
def test_relocation_by_small_offsets(arch, tokenizer, device):
    pc = engine(arch, tokenizer, device, layout="schema")
    for words in (1, 7, 40):
        pc.add_schema(f'<schema name="o"><module name="x">{" ".join(["w"] * words)}</module>'
                      f'<module name="a">{FOX}</module></schema>', replace=True)
        cmp = pc.compare('<prompt schema="o"><a/> What?</prompt>')
        assert cmp.max_abs_logit_diff <= 1e-3, (words, cmp)


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_absolute_positions_recompute_when_moved_and_stay_exact(arch, tokenizer, device):
    pc = engine(arch, tokenizer, device)
    res = pc.generate('<prompt schema="s"><a/><b/> Where?</prompt>', max_new_tokens=2)
    assert res.recomputed_modules == ("b",)  # `a` sits where it was encoded; `b` does not
    assert "a" in res.hit_modules or "a" in res.missed_modules
    cmp = pc.compare('<prompt schema="s"><a/><b/> Where?</prompt>')
    assert cmp.max_abs_logit_diff <= 1e-4, cmp


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("prompt", [
    '<prompt schema="s"><trip duration="3 days"/> Go.</prompt>',  # value shorter than len
    '<prompt schema="s"><trip duration=""/> Go.</prompt>',  # an empty value
    '<prompt schema="s"><b/><miami/> Swim?</prompt>',  # a union member after another module
    '<prompt schema="s"><tokyo/> Eat?</prompt>',
    '<prompt schema="s"><outer><inner/></outer> Nest?</prompt>',  # nested module imported
    '<prompt schema="s"><outer/> Nest?</prompt>',  # parent without its child
])
def test_params_unions_nesting_generate(arch, prompt, tokenizer, device):
    for layout in ("contiguous", "schema"):
        pc = engine(arch, tokenizer, device, layout=layout)
        first = pc.generate(prompt, max_new_tokens=3)  # every module missed: encoded, so computed
        res = pc.generate(prompt, max_new_tokens=3)
        assert len(res.token_ids) == 3 and res.cached_tokens > 0 == first.cached_tokens
        cmp = pc.compare(prompt)
        assert math.isfinite(cmp.max_abs_logit_diff) and math.isfinite(cmp.kl)


def test_param_value_is_computed_in_place(tokenizer):
    pc = engine("llama", tokenizer)
    plan = pc.plan('<prompt schema="s"><trip duration="3 days"/> Go.</prompt>')
    kinds = [(p.unit, tokenizer.decode(p.token_ids)) for p in plan.pieces]
    assert kinds[0] == ("trip", "Plan a trip for ")
    assert kinds[1] == (None, "3 days")
    assert kinds[2][0] == "trip" and "around the city" in kinds[2][1]
    # the value comes before cached tokens in the sequence: only a 4D mask keeps it causal
    # in a single pass; with it, a module at its own position plus its value matches full prefill
    # up to the module's text after the value, which was encoded next to the placeholder.
    cmp = pc.compare('<prompt schema="s"><trip duration="3 days"/> Go.</prompt>')
    assert cmp.max_abs_logit_diff < 10


def test_value_longer_than_len_is_a_pml_error(tokenizer):
    pc = engine("llama", tokenizer)
    with pytest.raises(PMLError) as e:
        pc.generate('<prompt schema="s">\n  <trip duration="a very long time indeed, many many days"/></prompt>')
    assert (e.value.line, e.value.column) == (2, 3)
    assert "duration" in e.value.message and "len is 4" in e.value.message


def test_import_after_text_is_a_pml_error(tokenizer):
    pc = engine("llama", tokenizer)
    with pytest.raises(PMLError, match="follows the prompt's own text"):
        pc.generate('<prompt schema="s">Question first <a/></prompt>')


def test_miss_is_encoded_used_and_written_back(tokenizer, device):
    pc = engine("llama", tokenizer, device)
    prompt = '<prompt schema="s"><a/><b/> Where?</prompt>'
    first = pc.generate(prompt, max_new_tokens=4)
    assert set(first.missed_modules) == {"a", "b"} and first.hit_modules == ()
    second = pc.generate(prompt, max_new_tokens=4)
    assert second.missed_modules == () and set(second.hit_modules) == {"a", "b"}
    assert first.token_ids == second.token_ids  # the same answer either way
    assert second.computed_tokens < first.computed_tokens


def test_foreign_entry_under_our_key_is_not_used(tokenizer):
    pc = engine("llama", tokenizer)
    prompt = '<prompt schema="s"><a/> What?</prompt>'
    reference = pc.generate(prompt, max_new_tokens=4)
    other = engine("qwen2", tokenizer)  # a different model's KV
    other.generate(prompt, max_new_tokens=1)
    plan = pc.plan(prompt)
    key = pc.store_keys("s", ["a"])["a"]
    pc.store.put(key, other.plan(prompt).kvs["a"])  # plant it under this engine's key
    res = pc.generate(prompt, max_new_tokens=4)
    assert "a" in res.missed_modules
    assert res.token_ids == reference.token_ids and plan.kvs["a"] is not None


def test_encode_precomputes_and_skips_stored(tokenizer, device):
    pc = engine("llama", tokenizer, device)
    report = pc.encode("s")
    assert report.num_modules >= 8 and report.num_tokens > 150
    again = pc.encode("s")
    assert again.num_modules == 0 and again.num_skipped == report.num_modules
    res = pc.generate('<prompt schema="s"><a/><b/> Where?</prompt>', max_new_tokens=2)
    assert res.missed_modules == ()
    with pytest.raises(ValueError, match="no module 'nope'"):
        pc.encode("s", ["nope"])


def test_plain_text_prompt(tokenizer, device):
    pc = engine("llama", tokenizer, device)
    res = pc.generate("Hello there, how are you?", max_new_tokens=3)
    assert res.cached_tokens == 0 and len(res.token_ids) == 3
    with pytest.raises(ValueError, match="empty prompt"):
        pc.generate("")


def test_bad_arguments(tokenizer):
    pc = engine("llama", tokenizer)
    for kwargs, match in [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
                          ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"stop": [""]}, "stop")]:
        with pytest.raises(ValueError, match=match):
            pc.generate("Hi", **kwargs)
    with pytest.raises(ValueError, match="valid: isolated"):
        PromptCache(pc.model, tokenizer, mode="nope")
    with pytest.raises(ValueError, match="valid: contiguous, schema"):
        PromptCache(pc.model, tokenizer, layout="nope")
    with pytest.raises(PMLError, match="unknown schema"):
        pc.generate('<prompt schema="nope"><a/></prompt>')


def test_sampling_is_seeded(tokenizer, device):
    pc = engine("llama", tokenizer, device)
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50)
    a = pc.generate("Once upon a time", seed=1, **kw)
    b = pc.generate("Once upon a time", seed=1, **kw)
    c = pc.generate("Once upon a time", seed=2, **kw)
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_stream_matches_generate_and_async(tokenizer, device):
    pc = engine("llama", tokenizer, device)
    prompt = '<prompt schema="s"><a/> What jumps?</prompt>'
    res = pc.generate(prompt, max_new_tokens=12)
    stream = pc.stream(prompt, max_new_tokens=12)
    pieces = list(stream)
    assert "".join(pieces) == res.text == stream.result.text
    assert stream.result.token_ids == res.token_ids

    async def run():
        astream = pc.astream(prompt, max_new_tokens=12)
        got = [p async for p in astream]
        return "".join(got), astream.result, await pc.agenerate(prompt, max_new_tokens=12)

    streamed, result, agen = asyncio.run(run())
    assert streamed == res.text == result.text and agen.token_ids == res.token_ids == result.token_ids

    async def bad():
        return [p async for p in pc.astream('<prompt schema="s"><nope/></prompt>')]

    with pytest.raises(PMLError, match="nope"):
        asyncio.run(bad())


def test_text_stream_holds_back_stop_strings(tokenizer):
    ids = tokenizer("alpha beta\n\ngamma delta", add_special_tokens=False)["input_ids"]
    ts = TextStream(tokenizer, stop=["\n\n"])
    out = ""
    for t in ids:
        out += ts.push(t)
        if ts.stopped:
            break
    out += ts.finish()
    assert out == "alpha beta" and ts.stopped
    ts = TextStream(tokenizer, stop=["zzz"])
    out = "".join(ts.push(t) for t in ids) + ts.finish()
    assert out == "alpha beta\n\ngamma delta" and not ts.stopped


@pytest.mark.smollm
def test_smollm2_cached_greedy_equals_full_prefill(smollm):
    model, tokenizer = smollm
    pc = PromptCache(model, tokenizer, store=MemoryStore())
    pc.add_schema('<schema name="doc"><module name="eiffel">The Eiffel Tower in Paris was completed in 1889 '
                  'as the entrance arch to the World\'s Fair. It is 330 metres tall.</module></schema>')
    prompt = '<prompt schema="doc"><eiffel/><user>When was the Eiffel Tower completed?</user></prompt>'
    pc.generate(prompt, max_new_tokens=1)  # stores the module: cached_tokens counts KV served from the store
    cached = pc.generate(prompt, max_new_tokens=24)
    full = pc.generate(prompt, max_new_tokens=24, use_cache=False)
    assert cached.token_ids == full.token_ids
    assert "1889" in cached.text
    assert cached.cached_tokens > 30 and full.cached_tokens == 0
    stopped = pc.generate(prompt, max_new_tokens=24, stop=["1889"])
    assert stopped.finish_reason == "stop" and "1889" not in stopped.text
    assert cached.text.startswith(stopped.text)
    assert pc.compare(prompt).max_abs_logit_diff < 1e-3


@pytest.mark.smollm
def test_smollm2_in_bf16_answers_as_full_prefill_does(smollm):
    model, tokenizer = smollm
    bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the CPU default where the CPU has bf16 units
    pc = PromptCache(bf16, tokenizer, store=MemoryStore())
    pc.add_schema('<schema name="doc"><module name="eiffel">The Eiffel Tower in Paris was completed in 1889 '
                  'as the entrance arch to the World\'s Fair. It is 330 metres tall.</module>'
                  '<module name="louvre">The Louvre in Paris opened as a museum in 1793.</module></schema>')
    prompt = '<prompt schema="doc"><louvre/><eiffel/><user>When was the Eiffel Tower completed?</user></prompt>'
    pc.generate(prompt, max_new_tokens=1)  # stores the modules
    cached = pc.generate(prompt, max_new_tokens=24)
    full = pc.generate(prompt, max_new_tokens=24, use_cache=False)
    assert cached.hit_modules == ("louvre", "eiffel") and "1889" in cached.text and "1889" in full.text
    assert pc.store.get(next(iter(pc.store.keys()))).keys.dtype == torch.bfloat16
    # bf16 rounds the module KV and the prefill differently: close, not equal (fp32 is, test above)
    comparison = pc.compare(prompt)
    assert comparison.top1_match and comparison.kl < 0.05, comparison


@pytest.mark.smollm
def test_smollm2_eos_ends_generation(smollm):
    model, tokenizer = smollm
    pc = PromptCache(model, tokenizer, store=MemoryStore())
    res = pc.generate("<|im_start|>user\nSay only the word hi.<|im_end|>\n<|im_start|>assistant\n",
                      max_new_tokens=200)
    assert res.finish_reason == "eos" and len(res.token_ids) < 200
    assert res.token_ids[-1] in pc.eos_ids


def test_reserved_layer_grows_and_crops_like_a_dynamic_layer():
    import torch
    from transformers.cache_utils import DynamicLayer

    from rag_promptcache.engine.kv.assemble import ReservedLayer

    buf_k, buf_v = torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)
    reserved, plain = ReservedLayer(buf_k, buf_v, 0), DynamicLayer()
    for n in (2, 1, 4, 1):  # the third update overflows the 3 reserved slots
        k, v = torch.randn(1, 2, n, 4), torch.randn(1, 2, n, 4)
        got, want = reserved.update(k, v), plain.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert reserved.get_seq_length() == plain.get_seq_length() == 8
    reserved.crop(-3)
    plain.crop(-3)
    assert torch.equal(reserved.keys, plain.keys) and reserved.get_seq_length() == 5
    k = torch.randn(1, 2, 1, 4)
    assert torch.equal(reserved.update(k, k)[0], plain.update(k, k)[0])


def test_entry_of_another_mode_under_our_key_is_not_used(tokenizer):
    iso, shared = engine("llama", tokenizer, mode="isolated"), engine("llama", tokenizer, mode="shared_prefix")
    assert iso.fingerprint == shared.fingerprint  # the same weights: only the mode differs
    prompt = '<prompt schema="s"><a/> What?</prompt>'
    planted = iso.plan(prompt).kvs["a"]
    shared.store.put(shared.store_keys("s", ["a"])["a"], planted)
    assert "a" in shared.generate(prompt, max_new_tokens=1).missed_modules


def test_a_prompt_record_for_an_unknown_schema_is_a_clear_error(tokenizer):
    from rag_promptcache.pml import ast

    pc = engine("llama", tokenizer)
    with pytest.raises(ValueError, match="unknown schema 'nope'; known: "):
        pc.generate(ast.Prompt("nope", (ast.Text("hi"),)))
