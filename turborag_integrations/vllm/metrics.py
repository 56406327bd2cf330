"""What the connector's workers did, in vLLM's own statistics and on its `/metrics`.

vLLM collects a connector's statistics from each worker after every step
(`get_kv_connector_stats`), adds them up across workers (`aggregate`), logs them with its
periodic throughput line (`reduce`) and hands them to the connector's Prometheus metrics
(`observe`). The claim itself is counted by vLLM already
(`vllm:external_prefix_cache_queries_total` / `_hits_total`); these are the worker's side:

| metric | what |
|---|---|
| `vllm:turborag_loaded_tokens_total` | prompt tokens written into the paged cache from blobs |
| `vllm:turborag_loaded_spans_total` | blobs (head, chunk or separator spans) written |
| `vllm:turborag_load_errors_total` | spans whose blob could not be read: vLLM computed them |
| `vllm:turborag_load_seconds` | per request: reading, re-rotating and writing its blobs |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTS = ("loaded_tokens", "loaded_spans", "load_errors")


@dataclass
class TurboRAGConnectorStats(KVConnectorStats):
    """One interval's worker figures: the counts, and each request's load time (serializable:
    vLLM sends it from the worker to the logger process)."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {**{name: 0 for name in COUNTS}, "load_seconds": []}

    def record(self, tokens: int, spans: int, errors: int, seconds: float) -> None:
        self.data["loaded_tokens"] += tokens
        self.data["loaded_spans"] += spans
        self.data["load_errors"] += errors
        self.data["load_seconds"].append(seconds)

    def is_empty(self) -> bool:
        return not self.data["load_seconds"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for name in COUNTS:
                self.data[name] += other.data[name]
            self.data["load_seconds"] = self.data["load_seconds"] + other.data["load_seconds"]
        return self

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["load_seconds"]
        return {**{f"turborag_{name}": self.data[name] for name in COUNTS},
                "turborag_loads": len(seconds),
                "turborag_load_ms_avg": round(1e3 * sum(seconds) / len(seconds), 3)
                if seconds else 0.0}


class TurboRAGPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:turborag_{name}", labelnames=labelnames,
                                    documentation=doc)
            for name, doc in (
                ("loaded_tokens", "Prompt tokens written into the KV cache from TurboRAG blobs."),
                ("loaded_spans", "TurboRAG blobs (head, chunk, separator spans) written."),
                ("load_errors", "TurboRAG spans whose blob could not be read (recomputed)."))}
        self._seconds = self._histogram_cls(
            name="vllm:turborag_load_seconds", labelnames=labelnames,
            documentation="Per request: reading, re-rotating and writing its TurboRAG blobs.",
            buckets=[1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        labels = self.per_engine_labelvalues[engine_idx]
        for name, counter in self._counters.items():
            if transfer_stats_data.get(name):
                counter.labels(*labels).inc(transfer_stats_data[name])
        for seconds in transfer_stats_data.get("load_seconds", ()):
            self._seconds.labels(*labels).observe(seconds)
