"""What the connector's scheduler side hands its worker side for one step.

vLLM sends it from the scheduler process to every worker (pickled): plain data, importable
without vLLM. connector.py registers `TurboRAGConnectorMetadata` as vLLM's KVConnectorMetadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.kv.blob import Fingerprint
from .claim import ClaimedSpan
from .ingest import IngestPlan


@dataclass
class LoadRequest:
    """What the worker writes for one request: spans from `first_token` on."""

    req_id: str
    spans: list[ClaimedSpan]
    first_token: int  # tokens before it are in vLLM's own prefix cache already
    block_ids: list[int]
    namespaces: tuple[str, ...] = ("",)  # where the spans' blobs lie, looked up in order


@dataclass
class SaveRequest:
    """What the worker stores for one ingestion request: its chunk's KV, read off its blocks."""

    req_id: str
    plan: IngestPlan
    block_ids: list[int]


@dataclass
class TurboRAGConnectorMetadata:
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)
    chunk_fp: Fingerprint | None = None
    prefix_fp: Fingerprint | None = None
