"""What every scenario shares: the run's settings, the loaded model, the text corpus, and timing.

The corpus is CPython's own `pydoc_data.topics` (on every machine, no download), cut into modules of
exactly N tokens so every system times the same token sequence. Timing is wall-clock around the
whole call, synchronised on CUDA, median of several runs after a warm-up; systems are interleaved
run by run so a noisy neighbour slows all of them alike and the ratios stay meaningful. The clock's
resolution is measured when the `Bench` is made (`resolution_s`, in the JSON), and one timed run
repeats its call until the span covers `timing.MIN_STEPS` steps of it (`timed`), so a call shorter
than a coarse clock's step is timed as a mean, not as zero. A duration measured inside a call (a
TTFT) can still be zero: ratios of those are None, written "below the clock's resolution".

Not here: any scenario's logic, or output formatting (report.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rag_promptcache.engine.batching.batcher import DEFAULT_ADMISSION
from rag_promptcache.pml.parser import escape
from rag_promptcache.rag.sample import topic_texts
from rag_promptcache.timing import MIN_STEPS, repeat, resolution

SYSTEM = "You are a helpful assistant. Answer the question using only the documents below.\n\n"
QUESTION = (
    "Using only the documents above, explain in a few sentences how this part of the Python language "
    "works, and name the statement or keyword involved?"
)


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One run's sizes. `quick()` is a shorter run (about five minutes on two CPU cores before the decode scenario grew, not re-timed); `full()` is the run docs/benchmarks.md reports."""

    contexts: tuple[int, ...] = (512, 1024, 2048, 4096)  # retrieved-context tokens for TTFT
    module_tokens: int = 256
    warmup: int = 1
    repeats_slow: int = 3  # full, prefix, miss: whole-prompt prefills
    repeats_fast: int = 7  # cached_memory, cached_disk, lower_bound
    warmup_each_context: bool = True
    questions: int = 24
    ks: tuple[int, ...] = (4, 8)
    continuation: int = 32  # greedy tokens compared / scored by NLL
    quality_configs: tuple[tuple[str, str], ...] = (  # the sweep behind the default (docs/fidelity.md)
        ("isolated", "none"), ("shared_prefix", "none"),
        ("isolated", "first_k:2"), ("isolated", "first_k:8"), ("shared_prefix", "first_k:2"),
        ("shared_prefix", "first_k:8"),
        ("isolated", "selective:0.15"), ("shared_prefix", "selective:0.15"), ("shared_prefix", "last:1"),
        ("shared_prefix", "last:2"), ("shared_prefix", "last:3"), ("shared_prefix", "attend:1"),
    )
    codecs: tuple[str, ...] = ("native", "fp16", "bf16", "int8", "k6v6", "k8v4", "int4", "cachegen")
    codec_k: int = 4  # the k of the per-codec quality rows
    faiss_sizes: tuple[int, ...] = (10_000, 100_000)
    faiss_queries: int = 200
    embed: bool = True
    store_repeats: int = 5
    recovery: str | None = None  # the engine's recovery in the TTFT and LangChain scenarios; None: its default
    ingest_topics: int = 29  # sample topics the ingest scenario ingests (29: all, ~15k tokens)
    ingest_workers: tuple[int, ...] = (1, 2)  # Ray worker counts compared with a local ingest
    ingest_prefill_tokens: int = 2048  # the full prefill an eager ingest's throughput is compared with
    # fidelity (answer accuracy against full prefill, bench/fidelity.py)
    fidelity_per_kind: int = 6  # documents per kind (six kinds and the reports): 42 in all
    fidelity_questions: int = 42
    fidelity_ks: tuple[int, ...] = (4, 8, 12)
    fidelity_settings: tuple[tuple[str, str], ...] = (  # first_k, attend and selective: docs/FIDELITY.md, by name
        ("isolated", "none"), ("shared_prefix", "none"), ("shared_prefix", "last:1"), ("shared_prefix", "last:2"),
        ("shared_prefix", "last:3"), ("shared_prefix", "question:0.05"),
    )
    fidelity_new_tokens: int = 32  # room for the first sentence: at 20, a quarter of the answers were cut before it ended
    fidelity_splits: tuple[str, ...] = ("bench", "heldout", "manuals")  # bench/fidelity.py SPLITS: chosen on one, confirmed on the others
    fidelity_codec: str = "native"  # the store codec the cached answers' modules pass through
    # codec rows per split and k: each codec's answers against fp16 modules' (rag/codec_eval.py), with
    # `fidelity_codec_recovery` (None: the engine's default, the adapter's where one is merged)
    fidelity_codecs: tuple[str, ...] = ("int8", "k6v6", "int4", "cachegen")
    fidelity_codec_recovery: str | None = None
    fidelity_seed_offset: int = 0  # added to each split's data seed: the same templates, other entities and facts
    fidelity_ttft_context: int = 2048  # the context of the speed-up the default is held to
    fidelity_ttft_questions: int = 3
    # The splits' prompts are retrieved densely, as the base model's reference runs (docs/bench/fidelity-*) were,
    # before hybrid retrieval. Since then the dense index embeds each chunk's title and section with its text
    # (chunker.search_text), so some prompts differ from the references' (every answer's module is still
    # retrieved): re-run the reference with this runner (--adapter none) before judging a difference of an answer.
    fidelity_retrieval: str = "dense"
    fidelity_neighbours: int = 0  # each split's modules encoded after their M nearest (rag/neighbours.py); 0: alone
    fidelity_neighbours_present: int = 0  # read so only where this many of them are in the prompt (else plain)
    dtype: str = "auto"  # the model's dtype for every scenario (model.loading.parse_dtype); auto: the device's default
    adapter: str = "default"  # the tuned adapter merged into the model (model/adapter.py): default, none or a directory
    decode_context: int = 2048  # retrieved-context tokens of the decode scenario's prompt
    decode_tokens: int = 128  # new tokens per decode run (EOS ignored)
    decode_dtypes: tuple[str, ...] = ("float32", "bfloat16")  # each system runs in each ("auto": the default)
    llamacpp: bool = True  # llama.cpp rows (bench/llamacpp.py) where llama-cpp-python is installed
    llamacpp_flash_attn: bool = False  # llama-cpp-python's default
    llamacpp_threads: int | None = None  # None: torch's (torch.get_num_threads()), as every other system
    llama_server: str | None = None  # the serve scenario's llama.cpp server binary (bench/llama_server.py); None: skipped
    serve_admission: str = DEFAULT_ADMISSION  # how the serve scenario's batcher admits whole prefills (batcher.py ADMISSIONS)
    chat_turns: int = 6  # the chat scenario: turns over the same documents
    chat_context: int = 2048  # its retrieved-context tokens
    chat_answer_tokens: int = 64  # at most this many greedy tokens per answer
    chat_repeats: int = 2  # whole conversations, each turn's systems interleaved
    # sustained (bench/sustained.py): novel questions against tiers smaller than the corpus
    sustained_tiers: tuple[str, ...] = ("memory", "memory+disk", "memory+redis")
    sustained_modules: int = 128  # the corpus
    sustained_module_tokens: int = 128
    sustained_k: int = 8
    sustained_questions: int = 300  # measured, after the warm-up
    sustained_warmup: int = 50
    sustained_window: int = 100  # the first and the last window compared
    sustained_full_every: int = 2  # the engine's full prefill of every n-th question
    sustained_memory_share: float = 0.25  # of the corpus's bytes: the memory tier's budget
    sustained_shared_share: float = 0.5  # the disk tier's, or Redis' (above what the empty server holds)
    sustained_prefix_prompts: float = 2.0  # the prefix cache's budget, in prompts
    sustained_zipf: float = 1.0  # popularity exponent of the simulated retrieval
    sustained_every: int = 10  # questions per point of the hit-rate plot
    sustained_judge_s: float = 2.0  # the speed-up check needs windows whose cached TTFT adds up to this
    # json (bench/structured.py): json_object answers under a small budget
    json_questions: int = 24
    json_max_tokens: int = 64

    @classmethod
    def quick(cls) -> BenchConfig:
        return cls(
            contexts=(512, 2048), repeats_slow=2, repeats_fast=5, warmup_each_context=False, questions=20, ks=(4,),
            quality_configs=(("isolated", "none"), ("shared_prefix", "none"), ("shared_prefix", "first_k:8"),
                             ("shared_prefix", "last:3")),
            faiss_queries=100, store_repeats=3, ingest_topics=8, fidelity_questions=12, fidelity_ks=(4, 12),
            fidelity_ttft_questions=1, sustained_modules=64, sustained_module_tokens=64, sustained_questions=120,
            sustained_warmup=20, sustained_window=40,
            fidelity_settings=(("shared_prefix", "none"), ("shared_prefix", "last:1"), ("shared_prefix", "last:2"),
                               ("shared_prefix", "last:3"), ("shared_prefix", "question:0.05")),
        )

    @classmethod
    def full(cls) -> BenchConfig:
        return cls()


@dataclass(slots=True)
class Bench:
    """The loaded model and the run's settings, handed to every scenario."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    config: BenchConfig
    log: Callable[[str], None] = print
    extras: dict[str, object] = field(default_factory=dict)  # scenario results later ones may reuse
    resolution_s: float = field(default_factory=resolution)  # the clock's step, measured when the run starts

    @property
    def min_span_s(self) -> float:
        """The shortest span one timed run covers: `MIN_STEPS` steps of the clock."""
        return MIN_STEPS * self.resolution_s

    @property
    def engine_options(self) -> dict[str, object]:
        # the prefix cache is off: scenarios time the same prompt several times, and would otherwise time
        # its reuse rather than module reuse (the chat scenario turns it on, as a chatbot runs)
        return {"prefix_cache_bytes": 0, **({} if self.config.recovery is None else {"recovery": self.config.recovery})}

    @property
    def device(self) -> torch.device:
        return self.model.device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, min_span_s: float = 0.0) -> tuple[float, object]:
    """Seconds per call of `fn` and its last result: called until the calls span `min_span_s` (once at
    least; `Bench.min_span_s`: enough steps of the clock)."""
    t = repeat(fn, min_span_s, before=lambda: sync(device))
    return t.seconds, t.result


def interleaved(
    systems: dict[str, tuple[Callable[[], object], int, int]], device: torch.device, min_span_s: float = 0.0,
) -> dict[str, list[float]]:
    """Time each system (fn, repeats, warm-ups) round-robin after its untimed warm-up calls → seconds per run
    (each run: `timed`, so a short call is called again until the run spans `min_span_s`)."""
    for fn, _, warmup in systems.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in systems}
    for r in range(max(n for _, n, _ in systems.values())):
        for name, (fn, n, _) in systems.items():
            if r < n:
                times[name].append(timed(fn, device, min_span_s)[0])
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# -- corpus ----------------------------------------------------------------------------------------


def windows(tokenizer: PreTrainedTokenizerBase, text: str, num_tokens: int, limit: int | None = None,
            exact: bool = True) -> list[str]:
    """Cut `text` into pieces that each tokenize (alone, no special tokens) to exactly `num_tokens`
    tokens (`exact`), or to at most that many. Decoded windows can re-tokenize differently at their
    edges, so a window that does not round-trip is nudged by a token."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    out: list[str] = []
    i = 0
    while i + (num_tokens if exact else 1) <= len(ids) and (limit is None or len(out) < limit):
        end = min(i + num_tokens, len(ids))
        piece = tokenizer.decode(ids[i:end])
        n = len(tokenizer(piece, add_special_tokens=False)["input_ids"])
        if exact and n != num_tokens:
            for cut in (end - 1, end + 1, end - 2, end + 2):
                piece = tokenizer.decode(ids[i:cut])
                if len(tokenizer(piece, add_special_tokens=False)["input_ids"]) == num_tokens:
                    break
            else:
                i += 1
                continue
        if piece.strip():
            out.append(piece)
        i = end
    return out


def module_texts(tokenizer: PreTrainedTokenizerBase, count: int, num_tokens: int) -> list[str]:
    """`count` modules of exactly `num_tokens` tokens, from the pydoc topics in sorted order."""
    out: list[str] = []
    for text in topic_texts().values():
        out.extend(windows(tokenizer, text, num_tokens, limit=count - len(out)))
        if len(out) >= count:
            return out
    raise ValueError(f"the pydoc topics hold fewer than {count} modules of {num_tokens} tokens")


def schema_pml(name: str, modules: dict[str, str], system: str = SYSTEM) -> str:
    """The corpus schema shape of rag/: instructions then every module, inside the system turn."""
    body = "".join(f'<module name="{m}">{escape(t)}</module>' for m, t in modules.items())
    return f'<schema name="{name}"><system>{escape(system)}{body}</system></schema>'


def fit_question(tokenizer: PreTrainedTokenizerBase, text: str, num_tokens: int) -> str:
    """`text` cut or padded (with QUESTION's words) to about `num_tokens` tokens."""
    words = text.split()
    filler = QUESTION.split()
    count = lambda ws: len(tokenizer(" ".join(ws), add_special_tokens=False)["input_ids"])  # noqa: E731
    while count(words) < num_tokens:
        words.append(filler[len(words) % len(filler)])
    while count(words) > num_tokens and len(words) > 1:
        words.pop()
    return " ".join(words)
