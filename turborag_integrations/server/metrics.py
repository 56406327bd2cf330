"""The server's Prometheus metrics, in the text exposition format (version 0.0.4).

Each app has a registry of its own (`Metrics.registry`): the process-wide default one would mix
two apps in one process, as in tests. What the server counts itself is prometheus_client's
counters and histograms; figures kept elsewhere (the scheduler's, the hot set's) are read at
each scrape (`LiveFigures`).

    turborag_requests_total{endpoint,status}     requests answered, by path and HTTP status
    turborag_requests_in_flight                  requests being answered now (streams included)
    turborag_queue_depth                         requests waiting for the model (429 past the limit)
    turborag_batch_size                          requests being decoded together now
    turborag_decode_steps_total, _rows_total     batched decode steps, and the requests they served
    turborag_ttft_seconds                        histogram: submission to first token, per generation
    turborag_decode_tokens_per_second            histogram: decode speed, per generation
    turborag_generations_total{finish_reason}    stop, length, or cancelled (the client left)
    turborag_cache_hits_total, _misses_total     chunk blobs found / not found for chunks in prompts
    turborag_cache_hit_ratio                     hits / (hits + misses) so far (0 before any)
    turborag_prompt_tokens_total, turborag_reused_tokens_total, turborag_completion_tokens_total
    turborag_indexed_chunks                      chunk texts the server finds in prompts
    turborag_rapid_requests_total                RAPID answers (`turborag_rapid`), however they ended
    turborag_rapid_drafted_tokens_total, turborag_rapid_accepted_tokens_total
                                                 their drafts verified, and those accepted

A RAPID answer counts as a generation too: its prompt tokens are its target's (the whole
context), its reused tokens those the target read from its prefix cache.

With tenants (a keys file), the same figures per tenant as well, for the admin who reads them:

    turborag_tenant_requests_total{tenant,endpoint,status}, turborag_tenant_generations_total{
    tenant,finish_reason}, turborag_tenant_{cache_hits,cache_misses,prompt_tokens,reused_tokens,
    completion_tokens}_total{tenant}

prometheus_client names counters without their `_total` (it adds it), and writes a `_created`
series beside each counter and histogram (PROMETHEUS_DISABLE_CREATED_SERIES=True turns those off).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..core.run import GenerationStats, RunStats

if TYPE_CHECKING:
    from ..core.rapid import RapidStats

# what generate_latest writes (the library's CONTENT_TYPE_LATEST names its 1.0.0 format)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
TOTALS = (("cache_hits", "Chunks in prompts whose KV blob was found in the store."),
          ("cache_misses", "Chunks in prompts with no KV blob (prefilled instead)."),
          ("prompt_tokens", "Prompt tokens of all generations."),
          ("reused_tokens", "Prompt tokens read from stored KV blobs instead of prefilled."),
          ("completion_tokens", "Tokens generated."))
RAPID_TOTALS = (("requests", "RAPID answers, however they ended."),
                ("drafted_tokens", "Tokens RAPID's drafter proposed for verification."),
                ("accepted_tokens", "Drafted tokens the target accepted."))


class LiveFigures:
    """A collector of values kept elsewhere, read when the metrics are scraped: gauges, and
    counters that only grow where they are kept."""

    def __init__(self):
        self._figures: list[tuple[type[Metric], str, str, Callable[[], float]]] = []

    def gauge(self, name: str, help: str, read: Callable[[], float]) -> None:
        self._figures.append((GaugeMetricFamily, name, help, read))

    def counter(self, name: str, help: str, read: Callable[[], float]) -> None:
        """`name` without `_total`, which the exposition adds."""
        self._figures.append((CounterMetricFamily, name, help, read))

    def collect(self) -> Iterator[Metric]:
        for family, name, help, read in self._figures:
            yield family(name, help, value=read())


def _value(counter: Counter) -> float:
    """The value of a counter without labels, as a scrape reads it."""
    (family,) = counter.collect()
    return next(s.value for s in family.samples if s.name.endswith("_total"))


class Metrics:
    """The figures of one app, in its own `registry`; safe to update from the event loop and
    the worker thread. `tenants`: count per tenant as well (a keys file)."""

    def __init__(self, *, queue_depth: Callable[[], float], batch_size: Callable[[], float],
                 decode_steps: Callable[[], float], decode_rows: Callable[[], float],
                 indexed_chunks: Callable[[], float], admission=None, tenants: bool = False):
        """admission: the engine's hot set (core/admission.py), whose figures render when it is
        on."""
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("turborag_requests", "HTTP requests answered.",
                                ("endpoint", "status"), registry=registry)
        self.in_flight = Gauge("turborag_requests_in_flight", "Requests being answered now.",
                               registry=registry)
        self.ttft = Histogram("turborag_ttft_seconds", "Time from the submission to the batch "
                              "scheduler to the first token (the wait for a place in the batch "
                              "included; the chunk lookup not).", buckets=TTFT_BUCKETS,
                              registry=registry)
        self.decode_rate = Histogram("turborag_decode_tokens_per_second", "Decode speed of a "
                                     "generation (tokens after the first, per second).",
                                     buckets=RATE_BUCKETS, registry=registry)
        self.generations = Counter("turborag_generations", "Generations, by how they ended "
                                   "(cancelled: the client left).", ("finish_reason",),
                                   registry=registry)
        self.totals = {name: Counter(f"turborag_{name}", help, registry=registry)
                       for name, help in TOTALS}
        self.rapid_totals = {name: Counter(f"turborag_rapid_{name}", help, registry=registry)
                             for name, help in RAPID_TOTALS}
        self.by_tenant: dict[str, Counter] | None = None
        if tenants:
            self.by_tenant = {
                "requests": Counter("turborag_tenant_requests", "HTTP requests answered, by "
                                    "tenant (\"\" before one is known).",
                                    ("tenant", "endpoint", "status"), registry=registry),
                "generations": Counter("turborag_tenant_generations", "Generations, by tenant "
                                       "and how they ended.", ("tenant", "finish_reason"),
                                       registry=registry),
                **{name: Counter(f"turborag_tenant_{name}", f"{help[:-1]}, by tenant.",
                                 ("tenant",), registry=registry) for name, help in TOTALS}}
        live = LiveFigures()
        live.gauge("turborag_queue_depth", "Requests waiting for the model (their first token, "
                   "or the end of an ingestion).", queue_depth)
        live.gauge("turborag_batch_size", "Requests being decoded together now.", batch_size)
        live.counter("turborag_decode_steps", "Batched decode steps run.", decode_steps)
        live.counter("turborag_decode_rows", "Requests served by the batched decode steps "
                     "(rows / steps: the mean batch size).", decode_rows)
        live.gauge("turborag_cache_hit_ratio", "Chunk blobs found / chunks looked up, so far.",
                   self._hit_ratio)
        live.gauge("turborag_indexed_chunks", "Chunk texts the server looks for in prompts.",
                   indexed_chunks)
        if admission is not None and admission.enabled:
            stats = admission.stats
            live.gauge("turborag_admission_pending", "Admitted chunks waiting for (or in) the "
                       "background encoder.", lambda: admission.queued_now)
            for name, help in (
                    ("retrievals", "Retrieved chunks counted by the hot set."),
                    ("queued", "Chunk encodes queued on a k-th retrieval."),
                    ("dropped", "Admissions dropped because the encode queue was full."),
                    ("encoded", "Admitted chunks encoded and stored in the background."),
                    ("failed", "Background encodes that failed (the chunk stays prefilled).")):
                live.counter(f"turborag_admission_{name}", help,
                             lambda name=name: getattr(stats, name))
        registry.register(live)

    def _hit_ratio(self) -> float:
        hits = _value(self.totals["cache_hits"])
        looked_up = hits + _value(self.totals["cache_misses"])
        return hits / looked_up if looked_up else 0.0

    def request_started(self) -> None:
        self.in_flight.inc()

    def request_ended(self, endpoint: str, status: int, tenant: str | None = None) -> None:
        self.in_flight.dec()
        self.requests.labels(endpoint, str(status)).inc()
        if tenant is not None and self.by_tenant is not None:
            self.by_tenant["requests"].labels(tenant, endpoint, str(status)).inc()

    def generation(self, stats: GenerationStats, tenant: str | None = None) -> None:
        """Count one generation that has ended (however it ended), for `tenant` too if given."""
        if self.by_tenant is None:
            tenant = None
        self._ended(stats, tenant)
        for name, value in (("cache_hits", stats.cache_hits),
                            ("cache_misses", stats.cache_misses),
                            ("prompt_tokens", stats.prompt_tokens),
                            ("reused_tokens", stats.reused_tokens),
                            ("completion_tokens", stats.new_tokens)):
            self.totals[name].inc(value)
            if tenant is not None:
                self.by_tenant[name].labels(tenant).inc(value)

    def rapid(self, stats: RapidStats) -> None:
        """Count one RAPID answer that has ended (however it ended). Never a tenant's."""
        self._ended(stats, None)
        for name, value in (("prompt_tokens", stats.target_prompt_tokens),
                            ("reused_tokens", stats.target_reused_tokens),
                            ("completion_tokens", stats.new_tokens)):
            self.totals[name].inc(value)
        for name, value in (("requests", 1), ("drafted_tokens", stats.drafted),
                            ("accepted_tokens", stats.accepted)):
            self.rapid_totals[name].inc(value)

    def _ended(self, stats: RunStats, tenant: str | None) -> None:
        """What every generation counts: how it ended, its time to first token, its speed."""
        reason = stats.finish_reason or "unknown"
        self.generations.labels(reason).inc()
        if tenant is not None:
            self.by_tenant["generations"].labels(tenant, reason).inc()
        if stats.new_tokens:
            self.ttft.observe(stats.ttft_s)
        if stats.new_tokens > 1:
            self.decode_rate.observe(stats.decode_tokens_per_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware that counts requests by endpoint and status, and those in flight.

    A path the app does not serve counts as endpoint "other" (arbitrary paths would make a
    label value each). A stream counts when it ends.
    """

    def __init__(self, app, metrics: Metrics, endpoints: Sequence[str]):
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)
        # count per tenant too (the principal the app recognised)
        self.tenants = metrics.by_tenant is not None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
        status = 500  # what an exception before the response started becomes

        async def send_and_note(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.metrics.request_started()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            tenant = None
            if self.tenants:  # set by the authentication inside; "" when it refused the key
                principal = scope.get("state", {}).get("principal")
                tenant = principal.tenant if principal is not None else ""
            self.metrics.request_ended(endpoint, status, tenant)
