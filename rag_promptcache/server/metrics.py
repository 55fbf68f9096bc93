"""`GET /metrics`: the server's numbers in Prometheus' text format, through `prometheus-client`.

Names follow vLLM's (`vllm:`) and llama.cpp server's (`llamacpp:`) conventions where they overlap, under
our own prefix `rag_promptcache:`:

- requests: `requests_total{endpoint, status}` (every /v1 response by HTTP status),
  `request_success_total{finished_reason}`, `num_requests_running` (the running batch),
  `num_requests_waiting` (the queue);
- latency histograms: `time_to_first_token_seconds`, `inter_token_latency_seconds` (between the text
  pieces a client receives; a piece may carry more than one token), `e2e_request_latency_seconds`;
- tokens: `prompt_tokens_total`, `generation_tokens_total`, and of the prompt tokens
  `prompt_tokens_cached_total` (KV from the store or the prefix cache) and `prompt_tokens_computed_total`;
- caches: `store_hits_total{tier}` / `store_misses_total{tier}` (modules' KV per tier: `all` is the
  store as the engine sees it, a hit in any tier), `store_bytes{tier}` (what each tier holds, up to its
  budget), `prefix_cache_queries_total`, `prefix_cache_hits_total` (requests that reused at least one
  token), `prefix_cache_repeats_total` (exact repeats: no prefill), `prefix_cache_bytes`;
- the corpus: `corpus_modules`, `corpus_modules_encoded`, `corpus_tokens`, `corpus_tokens_encoded` (how
  much of its module KV the store holds: a lazy corpus's grows with the questions, rag/lazy.py).

Counters the engine already keeps (store, prefix cache) and the batcher's gauges are read when scraped
(`_Live`); what only the server sees (statuses, latencies, tokens per answer) is observed per request.
Not here: per-client labels, multiprocess mode (the server is one process).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.engine.batching.batcher import Batcher, Handle
    from rag_promptcache.engine.result import Result
    from rag_promptcache.rag.lazy import Coverage

PREFIX = "rag_promptcache:"
# seconds; vLLM's TTFT buckets, which span a CPU's long prefills as well as a repeat's
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class Metrics:
    """The server's registry: what each request adds, and the engine's own counters read at scrape time."""

    def __init__(self, batcher: Batcher, engine: PromptCache, coverage: Callable[[], Coverage] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}requests", "Responses to /v1 requests by HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Answers finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds",
                             "Time between the text pieces of a streamed answer.", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Time from the request to its last token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished answers.", registry=r)
        self.cached = Counter(f"{PREFIX}prompt_tokens_cached",
                              "Prompt tokens whose KV came from the store or the prefix cache.", registry=r)
        self.computed = Counter(f"{PREFIX}prompt_tokens_computed", "Prompt tokens computed in their request.",
                                registry=r)
        self.generated = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", registry=r)
        self.served = Counter(f"{PREFIX}answers_served", "Answers by how their modules were served: store (every "
                              "one held), deferred (a miss computed in the request, stored after it), waited "
                              "(a miss encoded before the answer), none (no module).", ["served"], registry=r)
        r.register(_Live(batcher, engine, coverage))

    def finished(self, result: Result) -> None:
        """A request's answer is done: its tokens, finish reason and latencies."""
        self.success.labels(result.finish_reason).inc()
        self.ttft.observe(result.ttft_s)
        self.e2e.observe(result.total_s)
        self.prompt.inc(result.prompt_tokens)
        self.cached.inc(result.cached_tokens)
        self.computed.inc(result.computed_tokens)
        self.generated.inc(result.num_generated)
        self.served.labels(result.served).inc()

    async def pieces(self, handle: Handle) -> AsyncIterator[str]:
        """`handle`'s text pieces, the gaps between them observed; its result counted once it is done."""
        last = None
        async for piece in handle:
            now = time.perf_counter()
            if last is not None:
                self.itl.observe(now - last)
            last = now
            yield piece
        if handle.result is not None:
            self.finished(handle.result)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Live:
    """Read at each scrape: the batcher's gauges, the store's and the prefix cache's own counters."""

    def __init__(self, batcher: Batcher, engine: PromptCache, coverage: Callable[[], Coverage] | None = None) -> None:
        self.batcher, self.engine, self.coverage = batcher, engine, coverage

    def describe(self) -> list:
        return []  # collected only when scraped: nothing to check at registration

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests in the running batch.",
                                value=self.batcher.num_running)
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests queued for a row of the batch.",
                                value=self.batcher.num_waiting)
        held = GaugeMetricFamily(f"{PREFIX}store_bytes", "Bytes of module KV the store holds, per tier.", labels=["tier"])
        hits = CounterMetricFamily(f"{PREFIX}store_hits", "Module KV found in the store, per tier.", labels=["tier"])
        misses = CounterMetricFamily(f"{PREFIX}store_misses", "Module KV not found in the store, per tier.",
                                     labels=["tier"])
        store = self.engine.store
        for tier, stats in [("all", store.stats()), *tier_stats(store)]:
            hits.add_metric([tier], stats.num_hits)
            misses.add_metric([tier], stats.num_misses)
            held.add_metric([tier], stats.num_bytes)
        yield hits
        yield misses
        yield held
        tree = self.engine.prefix_cache.stats()
        yield GaugeMetricFamily(f"{PREFIX}prefix_cache_bytes", "Bytes of KV the prefix cache holds.", value=tree.num_bytes)
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_queries", "Requests that looked up the prefix cache.",
                                  value=tree.num_queries)
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_hits", "Requests that reused at least one token's KV.",
                                  value=tree.num_hits)
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_repeats", "Exact repeats: answered with no prefill.",
                                  value=self.engine.prefix_cache.num_repeats)
        bg = self.engine.background.stats()
        yield GaugeMetricFamily(f"{PREFIX}background_queue", "Missed modules waiting for the background encoder.",
                                value=bg.num_queued)
        for name, what, value in (("encoded", "Modules the background encoder stored.", bg.num_encoded),
                                  ("dropped", "Missed modules not queued: the queue was full.", bg.num_dropped),
                                  ("failed", "Background encodes or writes that failed.", bg.num_failed)):
            yield CounterMetricFamily(f"{PREFIX}background_{name}", what, value=value)
        if self.coverage is not None:
            cov = self.coverage()
            for name, what, value in (("corpus_modules", "Modules in the corpus.", cov.num_modules),
                                      ("corpus_modules_encoded", "Modules whose KV the store holds.", cov.num_encoded),
                                      ("corpus_tokens", "Module tokens in the corpus.", cov.num_tokens),
                                      ("corpus_tokens_encoded", "Module tokens whose KV the store holds.",
                                       cov.num_encoded_tokens)):
                yield GaugeMetricFamily(f"{PREFIX}{name}", what, value=value)


def tier_stats(store: object) -> list[tuple[str, object]]:
    """(name, stats) of each tier of a tiered store (`memory`, `disk`, `redis`); none for a single store."""
    tiers = getattr(store, "tiers", None) or []
    return [(type(t).__name__.removesuffix("Store").lower(), t.stats()) for t in tiers]


class CountStatuses:
    """ASGI middleware: each /v1 response counted by endpoint and status, streamed ones included."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(scope["path"], str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
