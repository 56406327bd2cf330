"""TurboRAG as a KV connector of stock vLLM: stitched chunk caches fed into vLLM's paged cache.

    python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --dtype float32 \\
        --kv-transfer-config '{"kv_connector": "TurboRAGConnector",
            "kv_connector_module_path": "turborag_integrations.vllm.connector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"store": "/path/to/store"}}'

vLLM builds the connector once in its scheduler process and once in every worker, and calls
each only with its own role's hooks. `TurboRAGConnector` reads its settings once
(`ConnectorConfig`, config.py: the keys of `kv_connector_extra_config`) and hands every hook to
the side for its role, as vLLM's own connectors do:

- the scheduler side (scheduler_side.py) claims the run `[head][chunk]…[chunk]` that starts an
  opted-in request's prompt from the stored blobs, and tells the workers what to load;
- the worker side (worker_side.py) writes the claimed blobs into the request's blocks, keys
  re-rotated to where each chunk sits;
- started as `kv_both`, the save role (save_side.py) also stores the chunks vLLM is sent to
  prefill as blobs: its scheduler half plans them, its worker half reads them off the cache.

What a step's scheduler hands its workers is plain data (metadata.py), so the sides import and
run without vLLM; this module is the one bound to vLLM's interface.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..core.prefill.rope import KeyRotator
from .config import ConnectorConfig
from .metadata import TurboRAGConnectorMetadata
from .metrics import TurboRAGConnectorStats, TurboRAGPromMetrics
from .save_side import check_save_support
from .scheduler_side import TurboRAGConnectorScheduler, turned_off
from .worker_side import TurboRAGConnectorWorker

log = logging.getLogger("turborag.vllm")

# vLLM's metadata base is an empty ABC: registered, the metadata stays importable without vLLM
KVConnectorMetadata.register(TurboRAGConnectorMetadata)


class TurboRAGConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        config = ConnectorConfig.from_extra_config(transfer.kv_connector_extra_config)
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning('TurboRAG: kv_load_failure_policy is %r: a blob that cannot be read at '
                        'load time fails its request; set "kv_load_failure_policy": "recompute" '
                        'to have vLLM compute those tokens instead',
                        transfer.kv_load_failure_policy)
        model_config = vllm_config.model_config
        scheduler = role == KVConnectorRole.SCHEDULER
        # the scheduler reads blobs only to learn their token ids: no RAM tier to fill
        rotator, store, off_reason = _open(config, model_config.hf_config,
                                           memory_bytes=0 if scheduler else 1 << 30)
        # kv_both (or kv_producer): ingestion requests are saved as blobs
        ingests = bool(getattr(transfer, "is_kv_producer", False))
        if ingests:
            check_save_support(vllm_config, config)
        self.connector_scheduler: TurboRAGConnectorScheduler | None = None
        self.connector_worker: TurboRAGConnectorWorker | None = None
        if scheduler:
            self.connector_scheduler = TurboRAGConnectorScheduler(
                config, store, model=model_config.model, dtype=model_config.dtype,
                ingests=ingests, kv_role=transfer.kv_role, off_reason=off_reason)
        else:
            self.connector_worker = TurboRAGConnectorWorker(
                store, rotator, block_size=vllm_config.cache_config.block_size,
                layers=int(getattr(model_config.hf_config, "num_hidden_layers", 0)),
                num_blocks=getattr(kv_cache_config, "num_blocks", None))

    # ---- scheduler side (scheduler_side.py) ---------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, block_ids)

    # ---- worker side (worker_side.py) ---------------------------------------------------------
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        self.connector_worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer already

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        self.connector_worker.save_kv_layer(self._get_connector_metadata(), layer_name,
                                            kv_layer)

    def wait_for_save(self):
        self.connector_worker.wait_for_save(self._get_connector_metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.get_block_ids_with_load_errors()

    # ---- statistics (metrics.py) --------------------------------------------------------------
    def get_kv_connector_stats(self) -> TurboRAGConnectorStats | None:
        if self.connector_worker is None:  # the scheduler's side loads nothing
            return None
        loads = self.connector_worker.take_loads()
        if not loads:
            return None
        stats = TurboRAGConnectorStats()
        for figures in loads:
            stats.record(*figures)
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> TurboRAGConnectorStats:
        return TurboRAGConnectorStats(data=data) if data is not None else TurboRAGConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return TurboRAGPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _open(config: ConnectorConfig, hf_config, *, memory_bytes: int):
    """(key rotator, store, ""); where one cannot be made, it is None and the third item says
    why: TurboRAG is then off, and vLLM serves every request causally."""
    try:
        rotator = KeyRotator.for_config(hf_config)
    except Exception as exc:  # UnsupportedRopeError, or a config we cannot read
        reason = f"its RoPE cannot be re-rotated: {exc}"
        turned_off(reason)
        return None, None, reason
    try:
        store = config.open_store(memory_bytes=memory_bytes)
    except Exception as exc:  # an unwritable folder, a refused connection
        reason = f"the store {config.store!r} cannot be opened: {exc}"
        turned_off(reason)
        return rotator, None, reason
    return rotator, store, ""
