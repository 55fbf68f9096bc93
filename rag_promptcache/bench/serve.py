"""Serving throughput: concurrent clients against the real HTTP server on new questions, batched decoding
vs one at a time, and llama.cpp's `llama-server` on the same token ids where its binary is given.

The server is the one `rag-promptcache serve` runs (FastAPI + uvicorn, the engine's continuous-batching
scheduler, max batch 8), started in this process on a free loopback port over the demo corpus (the
Python reference slice; the existing demo corpus when it was built with this model, else one built once
in a temporary folder). Clients are threads with their own HTTP connections, each streaming one chat
completion: greedy, `max_tokens` 64 and `ignore_eos`, so every answer is 64 tokens.

Every timed request is a new question (bench/serve_questions.py): each system (the server taking
requests one at a time, one server per batcher setting compared, each llama-server leg) has its own
engine and prefix cache (on, at the server's default size), over one store holding every module
before any leg, and is warmed with other questions (`WARM`, `max_tokens` 1). Within a repeat every
system gets the same new questions, so their rows compare the same work. An exact
repeat decodes from the prefix cache with no prefill: that is the row "8 at once, exact repeats" (the
last 8-at-once leg's questions again, right after it), never mixed into the others. Per leg: total generated tokens/s
over the leg's wall time, p50/p95 time to the first content chunk, p50/p95 time between a request's
consecutive content chunks (pooled over the leg's requests: what a prefill running between decode steps
stretches), the longest such gap (a stream stalled while other requests prefill), p50/p95 total
latency, and the prompt tokens each request computed rather than reused (the usage's `cached_tokens`).
The 8-client pair (at once, one at a time) runs `repeats` times, interleaved, each time on fresh
questions, and the table keeps each one's faster run: on a shared machine that is the run other
processes disturbed least; the JSON keeps every run.

`admission`: how our batcher admits whole prefills (engine/batching/batcher.py `ADMISSIONS`; bench CLI
`--serve-admission`), the same for every batcher setting compared: one process per policy.

`llama_server=PATH`: llama.cpp's server (bench/llama_server.py) over the bf16 GGUF of the same weights,
`--parallel 8`, the same threads, fed each question's prompt as our engine's own token ids (the prompt
the chat route builds: `CorpusChat.chat_prompt`, `plan(use_cache=False)`), warmed with the same
warm-up questions, timed on the same legs. Without the binary the JSON says why it was skipped.

Not here: single-request TTFT (`ttft.py`) or decode speed of one sequence.
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rag_promptcache.bench import llama_server as llama
from rag_promptcache.bench.common import Bench
from rag_promptcache.bench.serve_questions import TIMED, WARM, legs
from rag_promptcache.bench.tables import table
from rag_promptcache.engine.batching.batcher import DEFAULT_ADMISSION, DEFAULT_PREFILL_CHUNK
from rag_promptcache.store import MemoryStore

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.rag.chat import CorpusChat

LEVELS = (1, 4, 8, 16)
MAX_TOKENS = 64
MAX_BATCH = 8
REPEATS = 2  # of the 8-at-once and 8-one-at-a-time pair; the other levels run once
K = 4
OURS, LLAMA = "rag-promptcache", "llama-server"
SEQUENTIAL, CONCURRENT, REPEATED = "8 one at a time", "concurrent", "8 at once, exact repeats"


@dataclass(frozen=True, slots=True)
class _System:
    """One timed server: its label, the prefill settings of its batcher, how to send a question to it."""

    system: str
    prefill_chunk: int | None
    send: Callable[[str, int], llama.Timed]
    admission: str | None = None  # None: not our batcher


def run(bench: Bench, *, levels: tuple[int, ...] = LEVELS, repeats: int = REPEATS,
        prefill_chunks: tuple[int | None, ...] = (DEFAULT_PREFILL_CHUNK,),
        llama_server: str | Path | None = None, admission: str = DEFAULT_ADMISSION) -> dict[str, object]:
    """`prefill_chunks`: the batcher settings to compare (None: each prefill whole, admitted as `admission`
    says), each behind its own server and engine over the same corpus; the 8 one at a time run on a server
    of their own.
    `llama_server`: the path of llama.cpp's `llama-server` binary (None: that row is skipped)."""
    others = [n for n in levels if n != MAX_BATCH]
    sets = legs([MAX_BATCH] * repeats + others, TIMED)
    pair_sets, level_sets = sets[:repeats], dict(zip(others, sets[repeats:]))
    runs: list[dict[str, object]] = []

    def record(r: dict[str, object]) -> None:
        runs.append(r)
        bench.log(_line(r))

    with ExitStack() as stack:
        where: list[str] = []
        store = stack.enter_context(closing(MemoryStore()))  # every engine's, as a corpus's store is
        one_by_one = _serve(stack, bench, DEFAULT_PREFILL_CHUNK, where, store)
        served = [_serve(stack, bench, chunk, where, store, admission)[0] for chunk in prefill_chunks]
        # two llama-servers as ours, so no prompt cache holds a timed question it was sent before
        asked = [*WARM, *(q for qs in sets for q in qs)]
        peers, skipped = _llama_peers(stack, bench, one_by_one[1], one_by_one[2], llama_server, asked, count=2)
        peer_one, peer = peers or (None, None)
        for s in [one_by_one[0], *served, *peers]:
            _level(s.send, WARM, concurrent=True, max_tokens=1)  # warm-up: other questions, not timed
        for qs in pair_sets:  # the pair the target is about, interleaved so all see the same load
            for s in [one_by_one[0]] + ([peer_one] if peer_one else []):
                record(_level(s.send, qs, concurrent=False) | _labels(s, 1, SEQUENTIAL))
            for s in served + ([peer] if peer else []):
                record(_level(s.send, qs, concurrent=True) | _labels(s, MAX_BATCH, CONCURRENT))
        if repeats:  # right after the leg it repeats: the later legs' prompts would push it out of the prefix cache
            last = served[-1]
            record(_level(last.send, pair_sets[-1], concurrent=True) | _labels(last, MAX_BATCH, REPEATED))
        for n, qs in level_sets.items():
            for s in served + ([peer] if peer else []):
                record(_level(s.send, qs, concurrent=True) | _labels(s, n, CONCURRENT))
    return _summary(runs, repeats, prefill_chunks, where[0], skipped, admission)


def _serve(stack: ExitStack, bench: Bench, chunk: int | None, where: list[str], store: MemoryStore,
           admission: str = DEFAULT_ADMISSION) -> tuple[_System, CorpusChat, PromptCache]:
    """Our server with its own engine (its own prefix cache) over the demo corpus and `store`, on `stack`."""
    import uvicorn

    from rag_promptcache.engine import PromptCache
    from rag_promptcache.engine.batching.batcher import Batcher
    from rag_promptcache.rag.chat import CorpusChat
    from rag_promptcache.server.app import create_app

    # the prefix cache as the server runs it (the bench turns it off elsewhere): new questions are what
    # the legs time, and the exact repeats row is what it gives
    options = {**bench.engine_options, "prefix_cache_bytes": None}
    engine = PromptCache(bench.model, bench.tokenizer, store=store, name=bench.model_name, **options)
    corpus = demo_corpus(bench, engine, where)
    stack.callback(corpus.close)
    corpus.prepare()
    engine.encode(corpus.manifest.name)  # every module stored before any leg, as in a corpus `ingest` built
    chat = CorpusChat(corpus)
    batcher = Batcher(engine, max_batch=MAX_BATCH, max_queue=64, prefill_chunk=chunk, admission=admission)
    stack.callback(batcher.close)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app([(chat, batcher, "demo")], k=K), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def stop() -> None:
        server.should_exit = True
        thread.join(30)

    stack.callback(stop)
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    return _System(OURS, chunk, lambda q, n: _chat(url, q, n), admission), chat, engine


def _llama_peers(stack: ExitStack, bench: Bench, chat: CorpusChat, engine: PromptCache, binary: str | Path | None,
                 questions: Sequence[str], count: int) -> tuple[list[_System], str | None]:
    """`count` llama-servers over the bf16 GGUF, each with its own prompt cache, sent each question as the
    token ids our chat route builds for it; ([], why) where they cannot run."""
    from rag_promptcache.model.loading import DEFAULT_MODEL

    reason = llama.skip_reason(binary, gguf_known=bench.model_name == DEFAULT_MODEL)
    if reason is not None:
        bench.log(f"serve: llama-server row skipped: {reason}")
        return [], reason
    import torch
    from rag_promptcache.bench.llamacpp import default_ggufs

    ids: dict[str, list[int]] = {}
    for q in questions:
        prompt = chat.chat_prompt([("user", q)], k=K, max_new_tokens=MAX_TOKENS).prompt
        ids[q] = [i for p in engine.plan(prompt, use_cache=False).pieces for i in p.token_ids]
    ctx = max(map(len, ids.values())) + MAX_TOKENS + 16
    servers = [stack.enter_context(llama.Server(binary, default_ggufs()["bf16"], free_port(), threads=torch.get_num_threads(),
                                                parallel=MAX_BATCH, ctx_per_slot=ctx)) for _ in range(count)]
    for server in servers:
        bench.log(f"serve: llama-server at {server.url} ({' '.join(server.argv)})")
    return [_System(LLAMA, None, lambda q, n, server=server: server.stream(ids[q], n)) for server in servers], None


def _labels(s: _System, clients: int, mode: str) -> dict[str, object]:
    return {"system": s.system, "clients": clients, "mode": mode,
            "prefill_chunk": s.prefill_chunk if mode != SEQUENTIAL else None,
            "admission": s.admission if mode != SEQUENTIAL else None, "new_questions": mode != REPEATED}


def _summary(runs: list[dict[str, object]], repeats: int, chunks: tuple[int | None, ...], where: str,
             skipped: str | None, admission: str = DEFAULT_ADMISSION) -> dict[str, object]:
    best: dict[tuple[object, ...], dict[str, object]] = {}
    for r in runs:  # best of the repeats: the run the other tenants of the machine disturbed least
        key = (r["system"], r["clients"], r["mode"], r["prefill_chunk"])
        if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = r
    rows = sorted(best.values(), key=lambda r: (r["system"] != OURS, r["mode"] == REPEATED, r["mode"] == CONCURRENT,
                                                r["clients"], str(r["prefill_chunk"])))
    out: dict[str, object] = {
        "via": "HTTP server (uvicorn, in process) + scheduler", "corpus": where, "k": K, "max_tokens": MAX_TOKENS,
        "max_batch": MAX_BATCH, "repeats_8": repeats, "prefill_chunks": list(chunks), "admission": admission,
        "questions": "new in every leg",
        "rows": rows, "runs": runs, "llama_server": {"skipped": skipped} if skipped else {"ran": True}}
    seq = best.get((OURS, 1, SEQUENTIAL, None))
    if seq is not None:
        speedups = {str(c): _ratio(best.get((OURS, MAX_BATCH, CONCURRENT, c)), seq) for c in chunks}
        out |= {"speedup_8_concurrent_vs_sequential": speedups[str(chunks[-1])], "speedup_8_by_prefill_chunk": speedups}
    if not skipped:  # ours (the last batcher setting) over llama-server's, leg by leg
        theirs = {(r["clients"], r["mode"]): r for r in rows if r["system"] == LLAMA}
        out["x_llama_server"] = {
            _leg(r): _ratio(r, theirs.get((r["clients"], r["mode"]))) for r in rows
            if r["system"] == OURS and r["mode"] != REPEATED and r["prefill_chunk"] in (chunks[-1], None)}
    return out


def _ratio(a: dict[str, object] | None, b: dict[str, object] | None) -> float | None:
    """a's tokens/s over b's, None where either is missing or b measured nothing."""
    return None if a is None or b is None or not b["tokens_per_s"] else a["tokens_per_s"] / b["tokens_per_s"]


def _chat(url: str, question: str, max_tokens: int) -> llama.Timed:
    """One streamed chat completion of `question` from our server, timed as a client sees it."""
    import httpx

    body = {"model": "demo", "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last = 0.0, 0.0
    gaps: list[float] = []
    usage: dict[str, object] = {}
    with httpx.Client(timeout=600) as http, http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if not ttft:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                usage = chunk["usage"]
    details = usage.get("prompt_tokens_details") or {}
    return llama.Timed(ttft, time.perf_counter() - t0, int(usage.get("completion_tokens", 0)), tuple(gaps),
                       int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens", 0)))


def _level(send: Callable[[str, int], llama.Timed], questions: Sequence[str], *, concurrent: bool,
           max_tokens: int | None = None) -> dict[str, object]:
    """`questions` sent at once (`concurrent`) or one after another, `max_tokens` each (None: MAX_TOKENS)."""
    max_tokens = MAX_TOKENS if max_tokens is None else max_tokens
    results: list[llama.Timed | None] = [None] * len(questions)

    def one(i: int) -> None:
        results[i] = send(questions[i], max_tokens)

    t0 = time.perf_counter()
    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(questions)):
            one(i)
    wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    if len(done) < len(questions):
        raise RuntimeError(f"{len(questions) - len(done)} of {len(questions)} requests failed (see the log above)")
    ttfts, totals = sorted(r.ttft_s for r in done), sorted(r.total_s for r in done)
    tokens = sum(r.tokens for r in done)
    itl = sorted(g for r in done for g in r.gaps_s) or [0.0]
    return {"requests": len(questions), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p95_s": _pct(ttfts, 95),
            "itl_p50_s": _pct(itl, 50), "itl_p95_s": _pct(itl, 95), "itl_max_s": itl[-1],
            "latency_p50_s": _pct(totals, 50), "latency_p95_s": _pct(totals, 95),
            "prompt_tokens_per_request": sum(r.prompt_tokens for r in done) / len(done),
            "computed_tokens_per_request": sum(r.prompt_tokens - r.cached_tokens for r in done) / len(done)}


def _pct(xs: list[float], p: int) -> float:
    """Nearest-rank percentile of sorted `xs`."""
    return xs[min(len(xs) - 1, max(0, -(-p * len(xs) // 100) - 1))]


def _leg(r: dict[str, object]) -> str:
    return r["mode"] if r["mode"] != CONCURRENT else f"{r['clients']} at once"


def _line(r: dict[str, object]) -> str:
    chunk, whole = r.get("prefill_chunk"), ", whole prefills" + _admitted(r.get("admission"))
    setting = "" if r["mode"] == SEQUENTIAL or r["system"] != OURS else f", prefill chunk {chunk}" if chunk else whole
    return (f"serve, {r['system']}, {_leg(r)}{setting}: {r['tokens_per_s']:.1f} tokens/s, TTFT p50 {r['ttft_p50_s']:.2f}s "
            f"p95 {r['ttft_p95_s']:.2f}s, inter-token p50 {1e3 * r['itl_p50_s']:.0f}ms p95 {1e3 * r['itl_p95_s']:.0f}ms, "
            f"longest stall {r['itl_max_s']:.2f}s, latency p50 {r['latency_p50_s']:.2f}s p95 {r['latency_p95_s']:.2f}s, "
            f"{r['computed_tokens_per_request']:.0f} of {r['prompt_tokens_per_request']:.0f} prompt tokens computed per request")


def demo_corpus(bench: Bench, engine: PromptCache, where: list[str]):
    """The demo corpus opened with `engine`: the one in `where` (built or found by an earlier call), else
    the demo home's when this model built it, else one built in a temporary folder; its path into `where`."""
    from rag_promptcache.rag import Corpus, is_corpus
    from rag_promptcache.rag.records import Manifest
    from rag_promptcache.rag.sample import demo_home, sample_documents

    if where:
        return Corpus.open(where[0], engine)
    home = demo_home()
    if is_corpus(home):
        manifest = Manifest.from_json((home / "manifest.json").read_text(), str(home))
        if manifest.model == bench.model_name and manifest.fingerprint == engine.fingerprint:
            where.append(str(home))
            return Corpus.open(home, engine)
    path = Path(tempfile.mkdtemp(prefix="rag-promptcache-serve-")) / "demo-corpus"
    bench.log(f"serve: building the demo corpus in {path}")
    where.append(str(path))
    return Corpus.build(sample_documents(), path, engine=engine, progress=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def markdown(serve: dict[str, object]) -> list[str]:
    rows = serve["rows"]
    out = ["## Serving: concurrent clients on new questions (HTTP, batched decoding)", "", table(
        ["system", "clients", "mode", "prefill", "tokens/s", "TTFT p50 s", "TTFT p95 s", "inter-token p50 ms",
         "inter-token p95 ms", "longest stall s", "latency p50 s", "latency p95 s", "prompt tokens computed"],
        [[r.get("system", OURS), r["clients"], r["mode"], _chunk_label(r), r["tokens_per_s"], r["ttft_p50_s"],
          r["ttft_p95_s"], 1e3 * r.get("itl_p50_s", 0.0), 1e3 * r.get("itl_p95_s", 0.0), r.get("itl_max_s", 0.0),
          r["latency_p50_s"], r["latency_p95_s"],
          f"{r.get('computed_tokens_per_request', 0):.0f} / {r.get('prompt_tokens_per_request', 0):.0f}"]
         for r in rows]), ""]
    if "speedup_8_by_prefill_chunk" in serve:
        out += ["8 at once vs 8 one at a time, new questions: " + ", ".join(
            f"{x:.2f}x tokens/s ({'prefill chunk ' + c if c != 'None' else 'whole prefills' + _admitted(serve.get('admission'))})"
            for c, x in serve["speedup_8_by_prefill_chunk"].items() if x is not None)
            + f" (best of {serve.get('repeats_8', 1)} interleaved runs each; k={serve['k']}, max_tokens "
            f"{serve['max_tokens']} with ignore_eos, max batch {serve['max_batch']}; {serve['via']})", ""]
    peer = serve.get("llama_server", {})
    if peer.get("skipped"):
        out += [f"llama-server: not run ({peer['skipped']}).", ""]
    elif serve.get("x_llama_server"):
        out += ["Ours over llama-server, tokens/s: " + ", ".join(
            f"{leg} {x:.2f}x" for leg, x in serve["x_llama_server"].items() if x is not None), ""]
    return out


def _chunk_label(r: dict[str, object]) -> str:
    if r["mode"] == SEQUENTIAL or r.get("system", OURS) != OURS:
        return "-"
    return str(r["prefill_chunk"]) if r.get("prefill_chunk") else "whole" + _admitted(r.get("admission"))


def _admitted(admission: str | None) -> str:
    """The batcher's admission of whole prefills where it is not the default (None: a run before it)."""
    return "" if admission in (None, DEFAULT_ADMISSION) else f", admission {admission}"


def plots(serve: dict[str, object], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunk = serve.get("prefill_chunks", [None])[-1]  # the batcher's default: the last one compared
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for system, style in ((OURS, "-"), (LLAMA, ":")):
        rows = [r for r in serve["rows"] if r.get("system", OURS) == system and r["mode"] == CONCURRENT
                and (system != OURS or r.get("prefill_chunk") == chunk)]
        if not rows:
            continue
        xs = [r["clients"] for r in rows]
        axes[0].plot(xs, [r["tokens_per_s"] for r in rows], style, marker="o", label=f"{system}, at once")
        seq = next((r for r in serve["rows"] if r.get("system", OURS) == system and r["mode"] == SEQUENTIAL), None)
        if seq is not None:
            axes[0].axhline(seq["tokens_per_s"], color="gray", linestyle="--" if system == OURS else ":",
                            label=f"{system}, 8 one at a time")
        for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p95_s", "TTFT p95"), ("latency_p50_s", "latency p50")):
            axes[1].plot(xs, [r[key] for r in rows], style, marker="o", label=f"{system} {label}")
        for ax in axes:
            ax.set_xticks(xs)
    axes[0].set(xlabel="concurrent clients", ylabel="generated tokens/s (all clients)", title="Throughput, new questions")
    axes[1].set(xlabel="concurrent clients", ylabel="seconds", title="Per-request times")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"serve: {MAX_TOKENS} tokens per request, max batch {serve['max_batch']}, new questions in every leg")
    fig.tight_layout()
    path = Path(folder) / "serve.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]
