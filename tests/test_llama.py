"""Our Llama (model/llama.py) against transformers' LlamaForCausalLM: the same logits and KV bit for bit, the
same engine results, loaded where it should be and nowhere else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from rag_promptcache.engine import PromptCache
from rag_promptcache.engine.compute.runner import native_gqa
from rag_promptcache.model import llama
from rag_promptcache.store import MemoryStore
from tests.test_recovery import PROMPT, SCHEMA
from tests.tiny import build

ROOT = Path(__file__).resolve().parents[1]


def _saved(tmp_path: Path, arch: str = "llama", **overrides) -> Path:
    build(arch, **overrides).save_pretrained(tmp_path)
    return tmp_path


def _pair(directory: Path, dtype: torch.dtype):
    ours = llama.load(directory, torch.device("cpu"), dtype)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa").eval()
    return ours, theirs.to(dtype)  # as model/loading.py casts it (the rotary frequencies too)


def _passes(model, ids: torch.Tensor, gqa: bool) -> list[torch.Tensor]:
    """A prefill at shifted positions, a prefill against the cache, a step, a masked step, the base model."""
    dtype = model.dtype
    with torch.inference_mode(), (native_gqa(ids.device) if gqa else torch.enable_grad()):
        cache = DynamicCache(config=model.config)
        out = [model(input_ids=ids[:, :20], position_ids=torch.arange(5, 25)[None].expand(2, -1), use_cache=True,
                     cache=cache).logits]
        out.append(model(input_ids=ids[:, 20:28], position_ids=torch.arange(25, 33)[None].expand(2, -1),
                         use_cache=True, cache=cache).logits)
        out.append(model(input_ids=ids[:, 28:29], use_cache=True, cache=cache).logits)
        mask = torch.zeros(2, 1, 1, 30, dtype=dtype)
        mask[..., 3:7] = torch.finfo(dtype).min
        out.append(model(input_ids=ids[:, 29:30], attention_mask=mask, use_cache=True, cache=cache,
                         logits_to_keep=1).logits)
        out += [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]
        out.append(model.base_model(input_ids=ids[:, :7], use_cache=True).last_hidden_state)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_kv_equal_transformers_bit_for_bit(tmp_path, dtype, tied):
    directory = _saved(tmp_path, tie_word_embeddings=tied)
    assert llama.supports(directory)
    ours, theirs = _pair(directory, dtype)
    assert type(ours) is llama.LlamaForCausalLM and (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 128, (2, 30), generator=torch.Generator().manual_seed(1))
    for gqa in (False, True):  # the engine's CPU forwards run with SDPA's grouped-query switch on
        for a, b in zip(_passes(ours, ids, gqa), _passes(theirs, ids, gqa), strict=True):
            assert torch.equal(a, b), f"{gqa=} {(a.float() - b.float()).abs().max()=}"


def test_the_engine_answers_the_same_on_ours_and_transformers(tmp_path, tokenizer):
    directory = _saved(tmp_path, vocab_size=len(tokenizer))
    ours, theirs = _pair(directory, torch.float32)
    runs = []
    for model in (ours, theirs):
        pc = PromptCache(model, tokenizer, store=MemoryStore(), recovery="none", fallback="never")
        pc.add_schema(SCHEMA)
        # module encoding (the base forward), recovery's hooks on the attention modules, the lean forward
        kv = pc.plan(PROMPT).kvs["a"]
        answers = [pc.generate(PROMPT, recovery=r, max_new_tokens=6, ignore_eos=True).token_ids
                   for r in ("none", "last:1", "selective:0.25", "attend:1@1", "question:0.2@1")]
        runs.append((kv.keys, kv.values, answers, pc.compare(PROMPT, recovery="selective:0.5").max_abs_logit_diff))
    (k1, v1, a1, d1), (k2, v2, a2, d2) = runs
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert a1 == a2 and d1 == d2


def test_generate_is_transformers_on_the_same_weights(tmp_path):
    ours, theirs = _pair(_saved(tmp_path, tie_word_embeddings=True), torch.float32)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(2))
    got = ours.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, theirs.generate(input_ids=ids, max_new_tokens=6, do_sample=False))
    with pytest.raises(AttributeError):  # a private name is never looked up on transformers' class
        ours._no_such_thing
    made = ours.transformers_model()
    assert made.lm_head.weight.data_ptr() == ours.lm_head.weight.data_ptr() and "_transformers" not in dict(ours.named_modules())


def test_what_it_does_not_load_goes_to_transformers(tmp_path):
    assert not llama.supports(_saved(tmp_path / "qwen2", "qwen2"))
    assert not llama.supports(_saved(tmp_path / "bias", mlp_bias=True))
    assert not llama.supports(_saved(tmp_path / "rope", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                         "rope_theta": 10000.0}))
    assert not llama.supports(tmp_path / "nothing")
    directory = _saved(tmp_path / "plain")
    assert llama.supports(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    assert not llama.supports(directory)


def test_a_padding_mask_is_refused_by_name(tmp_path):
    ours = llama.load(_saved(tmp_path), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="padding mask"):
        ours(input_ids=torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0, 1, 1]]))


def test_tokenizers_load_as_autotokenizer_loads_them(tokenizer, tmp_path):
    """`tokenizer_from` loads the default model's tokenizer and the default embedder's as AutoTokenizer
    does: the same ids, model inputs, chat template and special tokens; the same class for the model's, and
    for the embedder's (`BertTokenizer`) transformers' generic fast tokenizer read from its tokenizer.json."""
    from transformers import AutoTokenizer

    from rag_promptcache.model.loading import tokenizer_from
    from rag_promptcache.rag.embed import resolve

    tokenizer.save_pretrained(tmp_path / "llm")
    texts = ["What does events.once return?", "Café naïve — 12,345 <|im_start|>user\nhi", ""]
    for directory, kwargs in ((tmp_path / "llm", {}), (resolve(None)[1], {"model_max_length": 256})):
        ours, auto = tokenizer_from(directory, **kwargs), AutoTokenizer.from_pretrained(str(directory), **kwargs)
        assert type(ours) is type(auto) or type(auto).__name__ == "BertTokenizer"
        assert ours(texts)["input_ids"] == auto(texts)["input_ids"] and ours.model_input_names == auto.model_input_names
        assert (ours.chat_template, ours.all_special_ids, ours.model_max_length, ours.padding_side) == (
            auto.chat_template, auto.all_special_ids, auto.model_max_length, auto.padding_side)


@pytest.mark.smollm
def test_the_default_model_loads_without_transformers_model_code():
    """In a fresh process, once its merged weights are cached (the first load merges them, with transformers):
    the default model is ours, and transformers' model code was never imported."""
    code = ("import sys; from rag_promptcache.model.loading import load_model; m, t = load_model(dtype='bfloat16'); "
            "print(type(m).__module__, 'transformers.modeling_utils' in sys.modules)")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["rag_promptcache.model.llama", "False"], out.stdout
