"""`GET /metrics`: the server's numbers in Prometheus' text format, through `prometheus-client`.

Names follow vLLM's (`vllm:`) and llama.cpp server's (`llamacpp:`) conventions where they overlap, under
our own prefix `rag_promptcache:`:

- requests: `requests_total{endpoint, status}` (every /v1 response by HTTP status),
  `request_success_total{corpus, finished_reason}`, `num_requests_running` (the running batches),
  `num_requests_waiting` (the queues);
- latency histograms: `time_to_first_token_seconds{corpus}`, `inter_token_latency_seconds{corpus}` (between
  the text pieces a client receives; a piece may carry more than one token), `e2e_request_latency_seconds{corpus}`;
- tokens: `prompt_tokens_total{corpus}`, `generation_tokens_total{corpus}`, and of the prompt tokens
  `prompt_tokens_cached_total{corpus}` (KV from the store or the prefix cache) and `prompt_tokens_computed_total{corpus}`;
- caches: `store_hits_total{corpus, tier}` / `store_misses_total{corpus, tier}` (modules' KV per tier: `all`
  is the corpus's store as the engine sees it, a hit in any tier), `store_bytes{corpus, tier}` (what each tier
  holds, up to its budget), `prefix_cache_queries_total`, `prefix_cache_hits_total` (requests that reused at
  least one token), `prefix_cache_repeats_total` (exact repeats: no prefill), `prefix_cache_bytes` (summed
  over the loaded models: corpora on one model share its prefix cache);
- each corpus: `corpus_modules{corpus}`, `corpus_modules_encoded{corpus}`, `corpus_tokens{corpus}`,
  `corpus_tokens_encoded{corpus}` (how much of its module KV its store holds: a lazy corpus's grows with
  the questions, rag/lazy.py).

`corpus` is the name a request's `model` uses for the corpus (its directory's name).

Counters the engine already keeps (store, prefix cache) and the batcher's gauges are read when scraped
(`_Live`); what only the server sees (statuses, latencies, tokens per answer) is observed per request.
Not here: per-client labels, multiprocess mode (the server is one process).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from rag_promptcache.engine import PromptCache
    from rag_promptcache.engine.batching.batcher import Batcher, Handle
    from rag_promptcache.engine.result import Result
    from rag_promptcache.rag.lazy import Coverage
    from rag_promptcache.store.base import Store

PREFIX = "rag_promptcache:"
# seconds; vLLM's TTFT buckets, which span a CPU's long prefills as well as a repeat's
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


@dataclass(frozen=True, slots=True)
class Watched:
    """One served corpus as /metrics reads it: its name, the batcher and engine it runs on (shared by
    corpora on one model), its store and how much of its KV that holds."""

    corpus: str
    batcher: Batcher
    engine: PromptCache
    store: Callable[[], Store]
    coverage: Callable[[], Coverage] | None = None


class Metrics:
    """The server's registry: what each request adds, and the engines' own counters read at scrape time."""

    def __init__(self, watched: Sequence[Watched]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}requests", "Responses to /v1 requests by HTTP status.",
                                ["endpoint", "status"], registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Answers finished, by finish reason.",
                               ["corpus", "finished_reason"], registry=r)
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to the first token.", ["corpus"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds",
                             "Time between the text pieces of a streamed answer.", ["corpus"], buckets=ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Time from the request to its last token.",
                             ["corpus"], buckets=E2E_BUCKETS, registry=r)
        self.prompt = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished answers.", ["corpus"], registry=r)
        self.cached = Counter(f"{PREFIX}prompt_tokens_cached",
                              "Prompt tokens whose KV came from the store or the prefix cache.", ["corpus"], registry=r)
        self.computed = Counter(f"{PREFIX}prompt_tokens_computed", "Prompt tokens computed in their request.",
                                ["corpus"], registry=r)
        self.generated = Counter(f"{PREFIX}generation_tokens", "Tokens generated.", ["corpus"], registry=r)
        self.served = Counter(f"{PREFIX}answers_served", "Answers by how their modules were served: store (every "
                              "one held), deferred (a miss computed in the request, stored after it), waited "
                              "(a miss encoded before the answer), none (no module).", ["corpus", "served"], registry=r)
        r.register(_Live(list(watched)))

    def finished(self, result: Result, corpus: str) -> None:
        """A request's answer is done: its tokens, finish reason and latencies, under its corpus."""
        self.success.labels(corpus, result.finish_reason).inc()
        self.ttft.labels(corpus).observe(result.ttft_s)
        self.e2e.labels(corpus).observe(result.total_s)
        self.prompt.labels(corpus).inc(result.prompt_tokens)
        self.cached.labels(corpus).inc(result.cached_tokens)
        self.computed.labels(corpus).inc(result.computed_tokens)
        self.generated.labels(corpus).inc(result.num_generated)
        self.served.labels(corpus, result.served).inc()

    async def pieces(self, handle: Handle, corpus: str) -> AsyncIterator[str]:
        """`handle`'s text pieces, the gaps between them observed; its result counted once it is done."""
        last = None
        gaps = self.itl.labels(corpus)
        async for piece in handle:
            now = time.perf_counter()
            if last is not None:
                gaps.observe(now - last)
            last = now
            yield piece
        if handle.result is not None:
            self.finished(handle.result, corpus)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Live:
    """Read at each scrape: the batchers' gauges, each corpus's store and the prefix caches' own counters."""

    def __init__(self, watched: list[Watched]) -> None:
        self.watched = watched
        # corpora on one model share its batcher and engine: each counted once
        self.batchers = list({id(w.batcher): w.batcher for w in watched}.values())
        self.engines = list({id(w.engine): w.engine for w in watched}.values())

    def describe(self) -> list:
        return []  # collected only when scraped: nothing to check at registration

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests in the running batches.",
                                value=sum(b.num_running for b in self.batchers))
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests queued for a row of a batch.",
                                value=sum(b.num_waiting for b in self.batchers))
        labels = ["corpus", "tier"]
        held = GaugeMetricFamily(f"{PREFIX}store_bytes", "Bytes of module KV the store holds, per tier.", labels=labels)
        hits = CounterMetricFamily(f"{PREFIX}store_hits", "Module KV found in the store, per tier.", labels=labels)
        misses = CounterMetricFamily(f"{PREFIX}store_misses", "Module KV not found in the store, per tier.",
                                     labels=labels)
        for w in self.watched:
            store = w.store()
            for tier, stats in [("all", store.stats()), *tier_stats(store)]:
                hits.add_metric([w.corpus, tier], stats.num_hits)
                misses.add_metric([w.corpus, tier], stats.num_misses)
                held.add_metric([w.corpus, tier], stats.num_bytes)
        yield hits
        yield misses
        yield held
        trees = [e.prefix_cache.stats() for e in self.engines]
        yield GaugeMetricFamily(f"{PREFIX}prefix_cache_bytes", "Bytes of KV the prefix caches hold.",
                                value=sum(t.num_bytes for t in trees))
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_queries", "Requests that looked up the prefix cache.",
                                  value=sum(t.num_queries for t in trees))
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_hits", "Requests that reused at least one token's KV.",
                                  value=sum(t.num_hits for t in trees))
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_repeats", "Exact repeats: answered with no prefill.",
                                  value=sum(e.prefix_cache.num_repeats for e in self.engines))
        stats = [e.background.stats() for e in self.engines]
        yield GaugeMetricFamily(f"{PREFIX}background_queue", "Missed modules waiting for the background encoder.",
                                value=sum(b.num_queued for b in stats))
        for name, what, field in (("encoded", "Modules the background encoder stored.", "num_encoded"),
                                  ("kept", "Of those, by-product entries: a question's prefill KV, stored with no "
                                   "forward (ingest --byproduct).", "num_kept"),
                                  ("dropped", "Missed modules not queued: the queue was full.", "num_dropped"),
                                  ("not_admitted", "Missed modules the admission rule did not queue (a full store's "
                                   "module missed once).", "num_deferred"),
                                  ("failed", "Background encodes or writes that failed.", "num_failed"),
                                  ("yielded", "Background jobs put back unencoded: a request arrived first.",
                                   "num_yielded")):
            yield CounterMetricFamily(f"{PREFIX}background_{name}", what, value=sum(getattr(b, field) for b in stats))
        covered = [(w.corpus, w.coverage()) for w in self.watched if w.coverage is not None]
        for name, what, field in (("corpus_modules", "Modules in the corpus.", "num_modules"),
                                  ("corpus_modules_encoded", "Modules whose KV the store holds.", "num_encoded"),
                                  ("corpus_tokens", "Module tokens in the corpus.", "num_tokens"),
                                  ("corpus_tokens_encoded", "Module tokens whose KV the store holds.",
                                   "num_encoded_tokens"),
                                  ("corpus_modules_after_neighbours", "Modules whose KV encoded after their neighbours "
                                   "the store holds, of a corpus keeping a plain entry beside it.", "num_after_neighbours")):
            values = [(corpus, v) for corpus, cov in covered if (v := getattr(cov, field)) is not None]
            if values:
                gauge = GaugeMetricFamily(f"{PREFIX}{name}", what, labels=["corpus"])
                for corpus, v in values:
                    gauge.add_metric([corpus], v)
                yield gauge


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
