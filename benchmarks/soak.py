"""The server as `rag-promptcache serve` runs it, in a process of its own over the demo corpus, on the bench's
model: a long fuzz run (`fuzz`) and a soak (`run`).

    python -m benchmarks.soak --out out/soak              # 20 minutes of mixed load
    python -m benchmarks.soak --fuzz --out out/fuzz       # schemathesis against the served corpus

fuzz: schemathesis' CLI over the server's own OpenAPI schema (`fuzz_command`; the checks are its own and
benchmarks/fuzz_hooks.py's), `FUZZ_EXAMPLES` generated cases per route and mode, with the API key and without.
The summary is what schemathesis' JSON report and the server's access log say: requests sent, statuses,
failures.

soak: `SOAK_MINUTES` (20) of mixed load from `SOAK_CLIENTS` (6) client threads, each drawing the next
request from `MIX`: chat streamed, chat whole, chat streamed and dropped after a few chunks (a client gone
mid-answer), a text completion, embeddings, the cheap GETs, and bad requests (malformed JSON, an unknown
field, an unknown model, a wrong key, `max_tokens` past the window). Every status is counted; each finished
request's latency falls in its 5-minute window (p50 / p95 per kind of request); once a minute the server
process's resident memory and open file descriptors are read from /proc, and what its in-memory caches
hold from its /metrics (the store's memory tier, up to 1 GiB by default, and the prefix cache, up to 256
MiB: they fill as new modules and prompts come, which is what they are for). The checks: no 5xx, no
request hung or refused, neither memory less the caches nor descriptors more than `GROWTH` above their
reading at the end of the first window (the raw memory's growth is reported beside), and each later
window's p50 chat latency within `STEADY` of the second window's (the first has the module KV's first
encodings and the prefix cache's first fills).

Not here: throughput against other servers (`serve.py`), what a fuzz finds fixed (tests/test_server_fuzz.py
holds the regressions).
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rag_promptcache.bench.common import Bench
from rag_promptcache.bench.serve import demo_corpus, free_port
from rag_promptcache.bench.serve_questions import TIMED, WARM

KEY = "sk-bench-soak"
FUZZ_EXAMPLES = 50  # generated cases per route and mode, besides the coverage phase's
SOAK_MINUTES = 20.0
SOAK_CLIENTS = 6  # concurrent clients, each a mix of the request kinds
ROOT = Path(__file__).resolve().parent.parent  # the repository: schemathesis imports benchmarks.fuzz_hooks from it
REQUEST_TIMEOUT_S = 120  # a request unanswered this long is a hung one
WINDOW_S = 300
SAMPLE_S = 60
GROWTH = 0.05
STEADY = 1.5
MAX_TOKENS = 32
FUZZ_MAX_TOKENS = 32  # valid fuzz cases' answers at most this long: the fuzz is about requests, the soak about time
FUZZ_REQUEST_TIMEOUT_S = 300  # a shared CPU under four fuzzing workers: slow is not hung
HUNG, REFUSED = 0, 1  # statuses the summary counts a request that got none under
# (kind, weight): what a client sends next
MIX = (("chat_stream", 4), ("chat", 3), ("chat_dropped", 2), ("completion", 2), ("embeddings", 2), ("get", 2),
       ("bad", 3))


def fuzz_command(url: str, report: Path, *, key: str | None, examples: int, seed: int,
                 request_timeout: float = REQUEST_TIMEOUT_S, schema: Path | None = None, workers: int = 4,
                 phases: str = "examples,coverage,fuzzing") -> list[str]:
    """schemathesis' CLI against the server at `url`, its requests carrying the API key `key` (None: no key),
    its JSON report to `report`. The schema is the server's /openapi.json, or the file `schema` (a server
    that wants a key serves its schema only with it). Run it with `fuzz_env()`, which loads
    benchmarks/fuzz_hooks.py's checks."""
    auth = ["-H", f"Authorization: Bearer {key}"] if key else []
    where = [str(schema), "--url", url] if schema is not None else [f"{url}/openapi.json"]
    return [sys.executable, "-m", "schemathesis.cli", "run", *where, *auth,
            "--checks", "all", "--exclude-checks", "positive_data_acceptance,use_after_free,ensure_resource_availability",
            "--max-examples", str(examples), "--seed", str(seed), "--request-timeout", str(request_timeout),
            "--phases", phases, "--workers", str(workers), "--suppress-health-check", "all",
            "--report", "json", "--report-json-path", str(report), "--output-truncate", "false"]


def fuzz_env(max_tokens: int | None = None) -> dict[str, str]:
    """The environment for `fuzz_command`: benchmarks/fuzz_hooks.py loaded, and valid cases' `max_tokens`
    capped at `max_tokens` (None: as generated)."""
    cap = {"RAG_PROMPTCACHE_FUZZ_MAX_TOKENS": str(max_tokens)} if max_tokens else {}
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "SCHEMATHESIS_HOOKS": "benchmarks.fuzz_hooks", "PYTHONPATH": path, "NO_COLOR": "1", **cap}


def fuzz(bench: Bench, examples: int = FUZZ_EXAMPLES) -> dict[str, object]:
    if importlib.util.find_spec("schemathesis") is None:
        raise ModuleNotFoundError("the fuzz run needs schemathesis: pip install 'rag-promptcache[test]'")
    import httpx

    out: dict[str, object] = {"examples_per_route": examples, "runs": {}}
    with _server(bench) as (proc, url, log, _):
        with tempfile.TemporaryDirectory() as tmp:
            schema = Path(tmp) / "openapi.json"
            schema.write_bytes(httpx.get(f"{url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).content)
            for name, key in (("with_key", KEY), ("without_key", None)):
                report = Path(tmp) / f"{name}.json"
                t0 = time.perf_counter()
                done = subprocess.run(fuzz_command(url, report, key=key, examples=examples, seed=51,
                                                   schema=schema, request_timeout=FUZZ_REQUEST_TIMEOUT_S),
                                      capture_output=True, text=True, env=fuzz_env(FUZZ_MAX_TOKENS))
                seconds = time.perf_counter() - t0
                summary = json.loads(report.read_text()) if report.exists() else {}
                out["runs"][name] = {"exit_code": done.returncode, "seconds": round(seconds, 1),
                                     "test_cases": summary.get("test_cases"), "failures": summary.get("failures"),
                                     "errors": summary.get("errors"), "valid_rates": summary.get("valid_rates")}
                bench.log(f"fuzz {name}: exit {done.returncode} in {seconds:.0f} s; {done.stdout.strip()[-3000:]}")
        out["alive"] = proc.poll() is None
        out["statuses"] = dict(sorted(Counter(str(s) for s in _statuses(log)).items()))
        out["requests"] = sum(out["statuses"].values())
    return out


def run(bench: Bench, minutes: float = SOAK_MINUTES, clients: int = SOAK_CLIENTS) -> dict[str, object]:
    with _server(bench) as (proc, url, _, model):
        return soak(url, proc, 60 * minutes, clients, model=model, key=KEY, log=bench.log)


def soak(url: str, proc: subprocess.Popen, duration_s: float, clients: int, *, model: str, key: str | None,
         log: Callable[[str], None] = print) -> dict[str, object]:
    """`clients` clients sending `MIX` to the server at `url` (process `proc`, serving `model`) for
    `duration_s`; a run shorter than 20 minutes (a test's) reads the server every `duration_s / 20` and
    judges latency per quarter of it."""
    window_s, sample_s = min(WINDOW_S, duration_s / 4), min(SAMPLE_S, duration_s / 20)
    load = Load(url, duration_s, clients, model=model, key=key)
    samples = load.run(lambda: (*_usage(proc.pid), _cache_bytes(url, key)), log, sample_s)
    return summarize(load, samples, duration_s, proc.poll() is None, window_s)


class Load:
    """`clients` threads sending `MIX` until `duration_s` has passed; what each request got, by time."""

    def __init__(self, url: str, duration_s: float, clients: int, *, model: str, key: str | None) -> None:
        self.url, self.duration_s, self.clients, self.model, self.key = url, duration_s, clients, model, key
        self.t0 = 0.0
        self.lock = threading.Lock()
        self.done: list[tuple[float, str, int, float]] = []  # (start, kind, status, seconds)

    def run(self, sample: Callable[[], tuple[int, int, int]], log: Callable[[str], None],
            sample_s: float = SAMPLE_S) -> list[tuple[float, int, int, int]]:
        """Run the load; `sample()` → (RSS bytes, open descriptors, bytes the caches hold) every `sample_s`
        → the samples by time."""
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        for t in threads:
            t.start()
        samples = [(0.0, *sample())]
        while (now := time.monotonic() - self.t0) < self.duration_s:
            time.sleep(max(0.0, min(sample_s * len(samples), self.duration_s) - now))
            samples.append((time.monotonic() - self.t0, *sample()))
            with self.lock:
                n, errors = len(self.done), sum(s >= 500 for _, _, s, _ in self.done)
            log(f"soak: {samples[-1][0] / 60:.1f} min, {n} requests, {errors} 5xx, RSS {samples[-1][1] / 2**20:.0f} MiB "
                f"(caches {samples[-1][3] / 2**20:.0f} MiB), {samples[-1][2]} descriptors")
        for t in threads:
            t.join(REQUEST_TIMEOUT_S + 10)
        return samples

    def _client(self, seed: int) -> None:
        import httpx

        rng = random.Random(seed)
        kinds = [k for k, w in MIX for _ in range(w)]
        questions = [*WARM, *TIMED]
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        with httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT_S, headers=headers) as http:
            while time.monotonic() - self.t0 < self.duration_s:
                kind = rng.choice(kinds)
                start = time.monotonic()
                try:
                    status = _send(http, kind, rng, rng.choice(questions), self.model)
                except httpx.TimeoutException:  # a hung request: no status at all
                    status = HUNG
                except httpx.TransportError:  # refused or cut: the server is not answering
                    status = REFUSED
                with self.lock:
                    self.done.append((start - self.t0, kind, status, time.monotonic() - start))


def _send(http, kind: str, rng: random.Random, question: str, model: str) -> int:
    chat = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0}
    if kind == "chat":
        return http.post("/v1/chat/completions", json=chat).status_code
    if kind in ("chat_stream", "chat_dropped"):
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data:")
                if kind == "chat_dropped" and events >= 3:
                    break  # gone mid-answer: the connection closes with the stream unread
            return r.status_code
    if kind == "completion":
        return http.post("/v1/completions", json={"model": model, "prompt": question,
                                                  "max_tokens": MAX_TOKENS}).status_code
    if kind == "embeddings":
        return http.post("/v1/embeddings", json={"model": model, "input": [question, question[::-1]]}).status_code
    if kind == "get":
        return http.get(rng.choice(("/v1/models", "/health", "/metrics", "/"))).status_code
    bad = rng.choice(("json", "field", "model", "key", "window"))
    if bad == "json":
        return http.post("/v1/chat/completions", content=f'{{"model": "{model}", "mess'.encode(),
                         headers={"content-type": "application/json"}).status_code
    if bad == "key":
        return http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code
    body = {**chat, "top_k": 5} if bad == "field" else {**chat, "model": "gpt-4o"} if bad == "model" else \
        {**chat, "max_tokens": 10**6}
    return http.post("/v1/chat/completions", json=body).status_code


def summarize(load: Load, samples: list[tuple[float, int, int, int]], duration_s: float, alive: bool,
              window_s: float = WINDOW_S) -> dict[str, object]:
    windows: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    statuses: Counter[str] = Counter()
    for start, kind, status, seconds in load.done:
        statuses[str(status)] += 1
        if 200 <= status < 300:
            windows[int(start // window_s)][kind].append(seconds)
    latency = [{"window_min": [round(w * window_s / 60, 2), round(min((w + 1) * window_s, duration_s) / 60, 2)],
                **{kind: {"n": len(xs), "p50_s": _pct(xs, 50), "p95_s": _pct(xs, 95)} for kind, xs in sorted(ks.items())}}
               for w, ks in sorted(windows.items())]
    per_minute = [{"minute": round(t / 60, 2), "rss_mib": round(rss / 2**20, 1), "fds": fds,
                   "caches_mib": round(held / 2**20, 1), "rss_less_caches_mib": round((rss - held) / 2**20, 1)}
                  for t, rss, fds, held in samples]
    after = [s for s in per_minute if s["minute"] >= window_s / 60]  # from the end of the first window
    checks: dict[str, object] = {"no_5xx": not any(int(s) >= 500 for s in statuses), "no_hung_or_refused":
                                 statuses[str(HUNG)] + statuses[str(REFUSED)] == 0, "server_alive": alive}
    if len(after) > 1:
        base = after[0]
        for name, key in (("rss_growth", "rss_mib"), ("rss_less_caches_growth", "rss_less_caches_mib"), ("fd_growth", "fds")):
            checks[name] = round(max(s[key] for s in after) / base[key] - 1, 4)
        # the caches fill up to their budgets as new modules and prompts come: that growth is theirs to hold
        checks["memory_steady"] = checks["rss_less_caches_growth"] <= GROWTH and checks["fd_growth"] <= GROWTH
    chats = [w["chat"]["p50_s"] for w in latency if "chat" in w and w["chat"]["n"]]
    if len(chats) > 2:
        checks["latency_ratio_max"] = round(max(chats[2:]) / chats[1], 3)
        checks["latency_steady"] = checks["latency_ratio_max"] <= STEADY
    return {"minutes": duration_s / 60, "clients": load.clients, "max_tokens": MAX_TOKENS,
            "mix": {k: w for k, w in MIX}, "requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())),
            "latency_by_window": latency, "server_by_minute": per_minute, "checks": checks}


def _pct(xs: list[float], p: int) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, max(0, -(-p * len(xs) // 100) - 1))], 4)


def _usage(pid: int) -> tuple[int, int]:
    """(resident bytes, open descriptors) of a process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
    return rss_kb * 1024, len(os.listdir(f"/proc/{pid}/fd"))


def _cache_bytes(url: str, key: str | None) -> int:
    """What the server's in-memory caches hold (its /metrics): the store's memory tier and the prefix cache."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60).text
    held = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("store_bytes") and sample.labels.get("tier") == "memory" or \
                    sample.name.endswith("prefix_cache_bytes"):
                held += sample.value
    return int(held)


def _statuses(log: Path) -> Iterator[int]:
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("logger") == "rag_promptcache.server.access":
                yield record["status"]


@contextmanager
def _server(bench: Bench) -> Iterator[tuple[subprocess.Popen, str, Path, str]]:
    """`serve` over the demo corpus (built once with the bench's model where the demo home has none) in a
    subprocess, with the API key and JSON logs; yields (process, base URL, its log, the model id) once
    /health answers."""
    import httpx

    from rag_promptcache.engine import PromptCache
    from rag_promptcache.store import MemoryStore

    where: list[str] = []
    engine = PromptCache(bench.model, bench.tokenizer, store=MemoryStore(), name=bench.model_name)
    demo_corpus(bench, engine, where).close()  # its modules' KV is encoded by the server, into the corpus's store
    with tempfile.TemporaryDirectory() as tmp:
        port, log = free_port(), Path(tmp) / "server.log"
        argv = [sys.executable, "-m", "rag_promptcache.cli", "serve", "--corpus", where[0], "--port", str(port),
                "--api-key", KEY, "--log-format", "json", "--dtype", bench.config.dtype, "--adapter", bench.config.adapter]
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 900
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}: {log.read_text()[-3000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not answer /health within 900 s")
                time.sleep(1)
            bench.log(f"soak/fuzz: serving {where[0]} at {url} (pid {proc.pid})")
            yield proc, url, log, Path(where[0]).resolve().name
        finally:
            proc.terminate()
            proc.wait(60)


def main(argv: list[str] | None = None) -> dict[str, object]:
    from benchmarks import harness

    ap = harness.parser("The server in its own process over the demo corpus: a soak of mixed load (soak.json), or with "
                        "--fuzz schemathesis against it (fuzz.json), in --out.")
    ap.add_argument("--fuzz", action="store_true", help="fuzz with schemathesis instead of the soak")
    ap.add_argument("--minutes", type=float, default=SOAK_MINUTES, help="the soak's length")
    ap.add_argument("--clients", type=int, default=SOAK_CLIENTS, help="the soak's concurrent clients")
    ap.add_argument("--examples", type=int, default=FUZZ_EXAMPLES, help="the fuzz's generated cases per route and mode")
    args = ap.parse_args(argv)
    bench = harness.load(args)
    if args.fuzz:
        return harness.write(bench, args.quick, args.out, "fuzz", fuzz(bench, args.examples))
    return harness.write(bench, args.quick, args.out, "soak", run(bench, args.minutes, args.clients))


if __name__ == "__main__":
    main()
