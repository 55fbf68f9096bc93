"""llama.cpp's own server (`llama-server`) as the serve scenario's peer, fed the same token ids as ours.

What a CPU user who does not pick this library serves with: continuous batching over `--parallel`
slots, each keeping its last prompt's KV for the next request's common prefix. The bench does not build
it (from the llama-cpp-python sdist: `cmake -B build -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF` in
`vendor/llama.cpp`, then `cmake --build build --target llama-server`); `rag-promptcache bench
--scenarios serve --llama-server PATH` runs the one at PATH. `Server` starts it on a free loopback
port over a GGUF (the bf16 one bench/llamacpp.py converts: bit-equal weights to ours in bf16), with
the bench's threads, waits for `/health`, and stops it on exit; `stream` sends one request to
`/completion` as token ids (`prompt` as a list of ints, greedy, `ignore_eos`, `cache_prompt`), streams
it, and times it. `skip_reason` says why the row cannot run (no such file, not executable, no GGUF for
the model) before anything starts.

Not here: the legs and the table (serve.py), the GGUF (llamacpp.py), building the binary.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

STARTUP_S = 120.0  # loading a small GGUF takes seconds; a loaded machine stretches it


@dataclass(frozen=True, slots=True)
class Timed:
    """One streamed request as a client sees it."""

    ttft_s: float  # request sent → first token received
    total_s: float  # request sent → stream closed
    tokens: int  # generated tokens the server reported
    gaps_s: tuple[float, ...] = ()  # between consecutive tokens received
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV the server reused rather than computed


def skip_reason(binary: str | Path | None, gguf_known: bool = True) -> str | None:
    """Why a llama-server row cannot run, or None when it can."""
    if binary is None:
        return "no llama-server given (--llama-server PATH)"
    path = Path(binary)
    if not path.is_file():
        return f"no llama-server at {path}"
    if not os.access(path, os.X_OK):
        return f"{path} is not executable"
    if not gguf_known:
        return "no GGUF of this model is known (only the default model's ships)"
    return None


class Server:
    """`llama-server` running over `gguf` on 127.0.0.1:`port` while the `with` block lasts."""

    def __init__(self, binary: str | Path, gguf: str | Path, port: int, *, threads: int, parallel: int,
                 ctx_per_slot: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                     "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot),
                     "--cont-batching"]
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log", delete=False)
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        import httpx

        self._proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become healthy ({' '.join(self.argv)}): {self.log_tail()}")

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()

    def log_tail(self, chars: int = 2000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-chars:]

    def stream(self, ids: Sequence[int], max_tokens: int) -> Timed:
        """One greedy completion of the token ids `ids`, `max_tokens` tokens with EOS ignored, streamed."""
        return stream(self.url, ids, max_tokens)


def stream(url: str, ids: Sequence[int], max_tokens: int) -> Timed:
    """POST `ids` to `url`/completion (llama-server's native route, which takes token ids) and time the stream."""
    import httpx

    body = {"prompt": [int(i) for i in ids], "n_predict": max_tokens, "temperature": 0, "top_k": 1,
            "ignore_eos": True, "cache_prompt": True, "stream": True}
    t0 = time.perf_counter()
    first, last, received = 0.0, 0.0, 0
    gaps: list[float] = []
    final: dict[str, object] = {}
    with httpx.Client(timeout=600) as http, http.stream("POST", f"{url}/completion", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"llama-server answered {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"llama-server: {event['error']}")
            if event.get("stop"):
                final = event
                continue
            now = time.perf_counter()  # one event per token, its text possibly empty (part of a character)
            if received:
                gaps.append(now - last)
            else:
                first = now - t0
            last, received = now, received + 1
    total = time.perf_counter() - t0
    timings = final.get("timings") if isinstance(final.get("timings"), dict) else {}
    tokens = int(final.get("tokens_predicted") or timings.get("predicted_n") or received)
    cached = int(final.get("tokens_cached", 0) or 0)
    if "prompt_n" in timings:  # tokens it computed for this prompt; the rest came from the slot's cache
        cached = max(0, len(ids) - int(timings["prompt_n"]))
    return Timed(first, total, tokens, tuple(gaps), len(ids), cached)
