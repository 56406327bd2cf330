"""The server's Prometheus metrics, in the text exposition format (version 0.0.4).

Written out by hand: a few counters, gauges and histograms need no client library, and each app
keeps its own figures (a process-wide registry would mix two apps in one process, as in tests).

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

With tenants (a keys file), the same figures per tenant as well, for the admin who reads them:

    turborag_tenant_requests_total{tenant,endpoint,status}, turborag_tenant_generations_total{
    tenant,finish_reason}, turborag_tenant_{cache_hits,cache_misses,prompt_tokens,reused_tokens,
    completion_tokens}_total{tenant}
"""

from __future__ import annotations

import math
import threading
from typing import Callable, Iterator, Sequence

from ..core.run import GenerationStats

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    escaped = (str(v).replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")
               for v in values)
    return "{" + ",".join(f'{n}="{v}"' for n, v in zip(names, escaped)) + "}"


def _header(name: str, help: str, kind: str) -> Iterator[str]:
    yield f"# HELP {name} {help}"
    yield f"# TYPE {name} {kind}"


class Counter:
    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        self.name, self.help, self.labels = name, help, tuple(labels)
        self.values: dict[tuple[str, ...], float] = {} if labels else {(): 0.0}

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        key = tuple(label_values)
        self.values[key] = self.values.get(key, 0.0) + amount

    def lines(self) -> Iterator[str]:
        yield from _header(self.name, self.help, "counter")
        for key, value in sorted(self.values.items()):
            yield f"{self.name}{_labels(self.labels, key)} {_number(value)}"


class Gauge:
    """A value read when the metrics are rendered (kind "counter": one that only grows, kept
    elsewhere)."""

    def __init__(self, name: str, help: str, read: Callable[[], float], kind: str = "gauge"):
        self.name, self.help, self.read, self.kind = name, help, read, kind

    def lines(self) -> Iterator[str]:
        yield from _header(self.name, self.help, self.kind)
        yield f"{self.name} {_number(self.read())}"


class Histogram:
    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        self.name, self.help = name, help
        self.bounds = (*sorted(buckets), math.inf)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[next(i for i, b in enumerate(self.bounds) if value <= b)] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> Iterator[str]:
        yield from _header(self.name, self.help, "histogram")
        total = 0
        for bound, count in zip(self.bounds, self.counts):
            total += count
            yield f'{self.name}_bucket{{le="{_number(bound)}"}} {total}'
        yield f"{self.name}_sum {_number(self.sum)}"
        yield f"{self.name}_count {self.count}"


class Metrics:
    """The figures of one app; safe to update from the event loop and the worker thread."""

    def __init__(self, *, queue_depth: Callable[[], float], batch_size: Callable[[], float],
                 decode_steps: Callable[[], float], decode_rows: Callable[[], float],
                 indexed_chunks: Callable[[], float], admission=None):
        """admission: the engine's hot set (core/admission.py), whose figures render when it is
        on."""
        self._lock = threading.Lock()
        self.in_flight = 0
        self.requests = Counter("turborag_requests_total", "HTTP requests answered.",
                                ("endpoint", "status"))
        self.generations = Counter("turborag_generations_total", "Generations, by how they "
                                   "ended (cancelled: the client left).", ("finish_reason",))
        self.ttft = Histogram("turborag_ttft_seconds", "Time from the submission to the batch "
                              "scheduler to the first token (the wait for a place in the batch "
                              "included; the chunk lookup not).", TTFT_BUCKETS)
        self.decode_rate = Histogram("turborag_decode_tokens_per_second", "Decode speed of a "
                                     "generation (tokens after the first, per second).",
                                     RATE_BUCKETS)
        self.totals = {name: Counter(f"turborag_{name}_total", help) for name, help in (
            ("cache_hits", "Chunks in prompts whose KV blob was found in the store."),
            ("cache_misses", "Chunks in prompts with no KV blob (prefilled instead)."),
            ("prompt_tokens", "Prompt tokens of all generations."),
            ("reused_tokens", "Prompt tokens read from stored KV blobs instead of prefilled."),
            ("completion_tokens", "Tokens generated."))}
        self.by_tenant = {
            "requests": Counter("turborag_tenant_requests_total", "HTTP requests answered, by "
                                "tenant (\"\" before one is known).",
                                ("tenant", "endpoint", "status")),
            "generations": Counter("turborag_tenant_generations_total", "Generations, by "
                                   "tenant and how they ended.", ("tenant", "finish_reason")),
            **{name: Counter(f"turborag_tenant_{name}_total", f"{c.help[:-1]}, by tenant.",
                             ("tenant",)) for name, c in self.totals.items()}}
        self.tenants = False  # whether any figure has a tenant (then the series above render)
        self.gauges = [
            Gauge("turborag_requests_in_flight", "Requests being answered now.",
                  lambda: self.in_flight),
            Gauge("turborag_queue_depth", "Requests waiting for the model (their first token, or "
                  "the end of an ingestion).", queue_depth),
            Gauge("turborag_batch_size", "Requests being decoded together now.", batch_size),
            Gauge("turborag_decode_steps_total", "Batched decode steps run.", decode_steps,
                  kind="counter"),
            Gauge("turborag_decode_rows_total", "Requests served by the batched decode steps "
                  "(rows / steps: the mean batch size).", decode_rows, kind="counter"),
            Gauge("turborag_cache_hit_ratio", "Chunk blobs found / chunks looked up, so far.",
                  self._hit_ratio),
            Gauge("turborag_indexed_chunks", "Chunk texts the server looks for in prompts.",
                  indexed_chunks),
        ]
        if admission is not None and admission.enabled:
            stats = admission.stats
            self.gauges += [
                Gauge("turborag_admission_pending", "Admitted chunks waiting for (or in) the "
                      "background encoder.", lambda: admission.queued_now),
                *(Gauge(f"turborag_admission_{name}_total", help,
                        lambda name=name: getattr(stats, name), kind="counter")
                  for name, help in (
                      ("retrievals", "Retrieved chunks counted by the hot set."),
                      ("queued", "Chunk encodes queued on a k-th retrieval."),
                      ("dropped", "Admissions dropped because the encode queue was full."),
                      ("encoded", "Admitted chunks encoded and stored in the background."),
                      ("failed", "Background encodes that failed (the chunk stays "
                                 "prefilled).")))]

    def _hit_ratio(self) -> float:
        hits = self.totals["cache_hits"].values[()]
        looked_up = hits + self.totals["cache_misses"].values[()]
        return hits / looked_up if looked_up else 0.0

    def request_started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def request_ended(self, endpoint: str, status: int, tenant: str | None = None) -> None:
        with self._lock:
            self.in_flight -= 1
            self.requests.inc(endpoint, str(status))
            if tenant is not None:
                self.tenants = True
                self.by_tenant["requests"].inc(tenant, endpoint, str(status))

    def generation(self, stats: GenerationStats, tenant: str | None = None) -> None:
        """Count one generation that has ended (however it ended), for `tenant` too if given."""
        with self._lock:
            self.generations.inc(stats.finish_reason or "unknown")
            if tenant is not None:
                self.tenants = True
                self.by_tenant["generations"].inc(tenant, stats.finish_reason or "unknown")
            if stats.new_tokens:
                self.ttft.observe(stats.ttft_s)
            if stats.new_tokens > 1:
                self.decode_rate.observe(stats.decode_tokens_per_s)
            for name, value in (("cache_hits", stats.cache_hits),
                                ("cache_misses", stats.cache_misses),
                                ("prompt_tokens", stats.prompt_tokens),
                                ("reused_tokens", stats.reused_tokens),
                                ("completion_tokens", stats.new_tokens)):
                self.totals[name].inc(amount=value)
                if tenant is not None:
                    self.by_tenant[name].inc(tenant, amount=value)

    def render(self) -> str:
        with self._lock:
            metrics = [self.requests, *self.gauges, self.ttft, self.decode_rate,
                       self.generations, *self.totals.values(),
                       *(self.by_tenant.values() if self.tenants else ())]
            return "\n".join(line for m in metrics for line in m.lines()) + "\n"


class CountRequests:
    """ASGI middleware that counts requests by endpoint and status, and those in flight.

    A path the app does not serve counts as endpoint "other" (arbitrary paths would make a
    label value each). A stream counts when it ends.
    """

    def __init__(self, app, metrics: Metrics, endpoints: Sequence[str], tenants: bool = False):
        self.app = app
        self.metrics = metrics
        self.endpoints = frozenset(endpoints)
        self.tenants = tenants  # count per tenant too (the principal the app recognised)

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
