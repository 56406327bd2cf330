"""The connector's worker side: claimed blobs written into vLLM's paged cache.

`start_load_kv`: each claimed blob is read from the store, its fingerprint checked, its keys
re-rotated to where it sits in the prompt, and every layer's keys and values written into the
request's blocks through the attention backend's own cache write (`impl.do_kv_cache_update`), so
the cache layout is the backend's business. A blob that cannot be read is reported through
`get_block_ids_with_load_errors`, and vLLM recomputes those blocks. An ingestion request's chunk
is read back off the cache and stored by the save role's worker half (save_side.py).
"""

from __future__ import annotations

import logging
import re
import time
from typing import NamedTuple

import torch

from ..core.prefill.rope import KeyRotator
from ..core.store import KVStore
from .heads import rank_heads
from .metadata import LoadRequest, TurboRAGConnectorMetadata
from .save_side import ChunkSaver

log = logging.getLogger("turborag.vllm")

_LAYER = re.compile(r"layers\.(\d+)\.")


class LoadFigures(NamedTuple):
    """One request's load, as vLLM's statistics count it (metrics.py)."""

    tokens: int
    spans: int
    errors: int
    seconds: float


class TurboRAGConnectorWorker:
    """One worker's loads and saves. `store`: None where it could not be opened (each claimed
    blob is then a load error); `layers`: the model's; `num_blocks`: the KV cache's; `ranks`:
    (this worker's tensor-parallel rank, the number of ranks), by default vLLM's."""

    def __init__(self, store: KVStore | None, rotator: KeyRotator | None, *, block_size: int,
                 layers: int, num_blocks: int | None = None, ranks: tuple[int, int] | None = None):
        self._store = store
        self._rotator = rotator
        self._block_size = block_size
        self._tp = ranks  # vLLM's are read at the first load or save
        self._load_errors: set[int] = set()
        self._loads: list[LoadFigures] = []  # since vLLM last collected them
        self._saver = ChunkSaver(store, block_size=block_size, layers=layers,
                                 num_blocks=num_blocks)

    def start_load_kv(self, meta, forward_context) -> None:
        if not isinstance(meta, TurboRAGConnectorMetadata) or not meta.loads:
            return
        layers = {}
        for name, layer in forward_context.no_compile_layers.items():
            m = _LAYER.search(name)
            if m is not None and getattr(layer, "kv_cache", None) is not None \
                    and hasattr(layer, "impl"):
                layers[int(m.group(1))] = layer
        for load in meta.loads:
            self._load(load, meta, layers)

    def _ranks(self) -> tuple[int, int]:
        """(this worker's tensor-parallel rank, the number of ranks), read from vLLM once."""
        if self._tp is None:
            from vllm.distributed import parallel_state

            self._tp = (parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_tensor_model_parallel_world_size())
        return self._tp

    def _load(self, load: LoadRequest, meta: TurboRAGConnectorMetadata, layers: dict) -> None:
        tp = self._ranks()
        bs = self._block_size
        block_ids = torch.tensor(load.block_ids, dtype=torch.long)
        started, written, spans, errors = time.perf_counter(), 0, 0, 0
        for span in load.spans:
            lo = max(span.start, load.first_token)
            hi = span.start + span.length
            if lo >= hi:
                continue
            fp = meta.prefix_fp if span.plain else (
                meta.chunk_fp.with_encoding(span.lead) if span.lead else meta.chunk_fp)
            try:
                if self._store is None:
                    raise RuntimeError("this worker could not open the store")
                # each namespace's store reads only its own keys: the first that holds it
                # (separators lie in the default namespace)
                names = (*load.namespaces, "") if span.separator else load.namespaces
                blob = next((b for n in names
                             if (b := self._store.namespace(n).get(span.key, fp)) is not None),
                            None)
            except Exception as exc:
                log.warning("TurboRAG blob %s unreadable, vLLM recomputes it: %s",
                            span.key[:12], exc)
                blob = None
            tokens = torch.arange(lo, hi)
            if blob is None or blob.num_tokens != span.length:
                if blob is None:
                    log.warning("TurboRAG blob %s missing at load time, vLLM recomputes its "
                                "tokens", span.key[:12])
                self._load_errors.update(load.block_ids[t // bs] for t in range(lo, hi))
                errors += 1
                continue
            slots = block_ids[tokens // bs] * bs + tokens % bs
            keys = blob.keys[:, :, lo - span.start:hi - span.start]  # [L, H, T, D]
            values = blob.values[:, :, lo - span.start:hi - span.start]
            offset = 0 if span.plain else span.start - blob.base_position
            for index, layer in layers.items():
                kv_cache = layer.kv_cache
                dtype, device = kv_cache.dtype, kv_cache.device
                # the attention layer knows how many KV heads this rank holds
                local = int(getattr(layer, "num_kv_heads", keys.shape[1]))
                heads = rank_heads(keys.shape[1], local, *tp)
                k = keys[index, heads].to(device=device, dtype=torch.float32)
                k = self._rotator.rotate(k, offset).to(dtype).transpose(0, 1).contiguous()
                v = values[index, heads].to(device=device, dtype=dtype).transpose(0, 1).contiguous()
                layer.impl.do_kv_cache_update(layer, k, v, kv_cache, slots.to(device))
            written, spans = written + hi - lo, spans + 1
        self._loads.append(LoadFigures(written, spans, errors, time.perf_counter() - started))

    def save_kv_layer(self, meta, layer_name: str, kv_layer: torch.Tensor) -> None:
        if not isinstance(meta, TurboRAGConnectorMetadata) or not meta.saves:
            return
        m = _LAYER.search(layer_name)
        if m is None:
            return
        from vllm.forward_context import get_forward_context

        layer = get_forward_context().no_compile_layers[layer_name]
        self._saver.save_layer(meta, int(m.group(1)), layer_name, layer, kv_layer)

    def wait_for_save(self, meta) -> None:
        if not isinstance(meta, TurboRAGConnectorMetadata) or not meta.saves:
            return
        self._saver.store_blobs(meta, *self._ranks())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_loads(self) -> list[LoadFigures]:
        """The loads since the last call (vLLM collects them after every step)."""
        loads, self._loads = self._loads, []
        return loads
