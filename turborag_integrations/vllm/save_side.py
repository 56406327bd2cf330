"""The connector's save role (ingestion, `"kv_role": "kv_both"`): blobs made by vLLM's prefill.

A request whose `kv_transfer_params` holds `"turborag_ingest": true` and whose prompt is the
anchor's token ids then a chunk's (ingest.py) is prefilled by vLLM like any other. Its
scheduler half (`Ingestions`) plans it when vLLM first asks for its matched tokens, sends its
block ids in the step that completes its prompt, and answers with what was stored when it
finishes. Its worker half (`ChunkSaver`): `save_kv_layer` reads every layer's keys and values of
the chunk's positions off the paged cache (layout.py: the layout is learned from the backend's
own cache write) and `wait_for_save` stores them as the blob `ChunkEncoder` makes — same
fingerprint, encoding, base_position and key. Prefix-cache hits are read like computed blocks:
they hold the causal KV of the same tokens. Under tensor parallelism each rank reads its own KV
heads and rank 0 stores them gathered. Training-free encodings only, in the model's dtype, with
the KV heads split evenly over the tensor-parallel ranks of one pipeline stage: anything else
is refused at startup (`check_save_support`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from ..core.kv.blob import Fingerprint, KVBlob
from ..core.store import KVStore
from .config import ConnectorConfig
from .ingest import IngestPlan, IngestRequestError, plan_ingest
from .layout import BlockLayout, UnreadableCacheLayout, probe_layout
from .metadata import SaveRequest, TurboRAGConnectorMetadata
from .model_setup import ModelSetup

log = logging.getLogger("turborag.vllm")


def check_save_support(vllm_config, config: ConnectorConfig) -> None:
    """Refuse, at startup, a save side whose blobs would not be `ChunkEncoder`'s: a blob holds
    every KV head of every layer, in the dtype its fingerprint names."""
    parallel = getattr(vllm_config, "parallel_config", None)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    heads = int(getattr(vllm_config.model_config.hf_config, "num_key_value_heads", 0) or 0)
    if pp > 1 or (tp > 1 and (not heads or heads % tp)):
        # tensor-parallel ranks that split the KV heads evenly each read theirs, gathered into
        # one blob (wait_for_save); a rank of another pipeline stage holds other layers, and
        # replicated heads would be gathered twice: neither is written
        raise ValueError(
            f"TurboRAGConnector saves chunk blobs from tensor-parallel ranks that split the "
            f"KV heads evenly, in one pipeline stage (here tensor_parallel_size {tp} over "
            f"{heads or '?'} KV heads, pipeline_parallel_size {pp}): ingest with a vLLM whose "
            "tensor_parallel_size divides the KV heads — its blobs serve vLLMs of any rank "
            "count — and run this one as kv_consumer")
    cache_dtype = getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto")
    if cache_dtype not in (None, "auto"):
        raise ValueError(f"TurboRAGConnector cannot save blobs from a {cache_dtype} KV cache: a "
                         "blob holds the model dtype's keys and values (use --kv-cache-dtype "
                         "auto, or kv_consumer)")
    dtype = str(vllm_config.model_config.dtype).replace("torch.", "")
    if config.blob_dtype and config.blob_dtype != dtype:
        raise ValueError(f"TurboRAGConnector saves blobs in vLLM's dtype ({dtype}), not in "
                         f"blob_dtype {config.blob_dtype!r}: drop blob_dtype, or run vLLM in "
                         f"{config.blob_dtype} to ingest")


# ---- the scheduler's half ---------------------------------------------------------------------
@dataclass
class Ingestion:
    """The scheduler's record of one ingestion request, until it finishes."""

    plan: IngestPlan | None = None
    key: str = ""
    error: str = ""
    existing: bool = False  # stored before: nothing to save
    block_ids: list[int] = field(default_factory=list)
    sent: bool = False  # handed to the worker

    @property
    def wanted(self) -> bool:
        return self.plan is not None and not (self.error or self.existing or self.sent)


class Ingestions:
    """The scheduler's ingestion requests, by request id. `refusal`: why this vLLM cannot
    ingest ("" where it can: then `store`, `setup` and `chunk_fp` are the scheduler's)."""

    def __init__(self, store: KVStore | None, setup: ModelSetup | None,
                 chunk_fp: Fingerprint | None, *, salt_prefix: str, refusal: str = ""):
        self._store, self._setup, self._chunk_fp = store, setup, chunk_fp
        self._salt_prefix = salt_prefix
        self._refusal = refusal
        self._requests: dict[str, Ingestion] = {}

    def __bool__(self) -> bool:
        return bool(self._requests)

    def plan(self, request, params: dict) -> None:
        self._requests[request.request_id] = self._plan(request, params)

    def _plan(self, request, params: dict) -> Ingestion:
        if self._refusal:
            return Ingestion(error=self._refusal)
        setup = self._setup
        try:
            plan = plan_ingest(params, request.prompt_token_ids or [], setup.anchor_ids,
                               max_chunk_tokens=setup.max_chunk_tokens,
                               salt=request.cache_salt, salt_prefix=self._salt_prefix,
                               context_tokens=setup.context_tokens)
        except IngestRequestError as exc:
            return Ingestion(error=str(exc))
        store = self._store.namespace(plan.namespace)
        # a lead blob is keyed by its head's encoding, as the HF engine's (core/library.py)
        fp = self._chunk_fp.with_encoding(plan.lead) if plan.lead else self._chunk_fp
        key = store.key(fp, plan.chunk_ids)
        existing = store.contains(key)
        alone = len(setup.anchor_ids)  # ingestion runs only without soft tokens
        if existing and plan.anchor_len > alone and not plan.lead:
            # as encode_chunks does: a blob encoded alone (at query time, by an HF engine on
            # the same store) gives way to this one, encoded after its document's context
            if store.base_position(key) == alone:
                existing, plan = False, replace(plan, replace=True)
        if existing and plan.doc_id:
            store.add_ref(key, plan.doc_id)  # as encode_chunks records a chunk stored before
        return Ingestion(plan, key, existing=existing)

    def schedule_saves(self, meta: TurboRAGConnectorMetadata, scheduler_output) -> None:
        """Hand the worker each ingestion request whose prompt this step completes, with all its
        blocks (those computed in earlier steps of a chunked prefill and the prefix-cache hits
        included: the worker reads the chunk's KV off them)."""
        scheduled = scheduler_output.num_scheduled_tokens
        steps = [(new.req_id, new.block_ids, False, new.num_computed_tokens)
                 for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += [(req_id, cached.new_block_ids[i], req_id not in cached.resumed_req_ids,
                   cached.num_computed_tokens[i]) for i, req_id in enumerate(cached.req_ids)]
        for req_id, block_ids, append, computed in steps:
            ingestion = self._requests.get(req_id)
            if ingestion is None or not ingestion.wanted:
                continue
            if block_ids is not None:
                new_blocks = list(block_ids[0])
                ingestion.block_ids = ingestion.block_ids + new_blocks if append else new_blocks
            if computed + scheduled.get(req_id, 0) >= ingestion.plan.prompt_len:
                meta.saves.append(SaveRequest(req_id, ingestion.plan, list(ingestion.block_ids)))
                ingestion.sent = True

    def finished(self, req_id: str) -> dict | None:
        """What a finished ingestion request is answered (None: it was not one)."""
        ingestion = self._requests.pop(req_id, None)
        if ingestion is None:
            return None
        if ingestion.error:
            return {"error": ingestion.error}
        plan = ingestion.plan
        # the worker stored it (or failed) in the step that completed the prompt, before vLLM
        # finished the request: the store says which
        stored = ingestion.existing or (ingestion.sent and self._saved(ingestion))
        result = {"key": ingestion.key, "tokens": len(plan.chunk_ids), "stored": stored,
                  "existing": ingestion.existing, "replaced": plan.replace and stored}
        if plan.lead:
            result["lead"] = True
        if not stored:
            result["error"] = ("the worker did not store the blob (vLLM's log says why)"
                               if ingestion.sent else
                               "the request ended before its prompt was computed")
        return result

    def _saved(self, ingestion: Ingestion) -> bool:
        """Whether the store holds this ingestion's blob; where it replaces one encoded alone,
        whether the blob now stored is the new one (it records the context in its position)."""
        store = self._store.namespace(ingestion.plan.namespace)
        if not ingestion.plan.replace:
            return store.contains(ingestion.key)
        return store.base_position(ingestion.key) == ingestion.plan.anchor_len


# ---- the worker's half ------------------------------------------------------------------------
def _tp_cpu_group():
    """The tensor-parallel group's CPU (gloo) side: the saved KV is on the host already."""
    from vllm.distributed import parallel_state

    return parallel_state.get_tp_group().cpu_group


def _on_every_rank(flag: bool) -> bool:
    """True when `flag` is true on every tensor-parallel rank."""
    value = torch.tensor([int(flag)])
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=_tp_cpu_group())
    return bool(value.item())


def _gather_heads(local: torch.Tensor) -> torch.Tensor:
    """[layers, heads of this rank, tokens, dim] of every rank, joined in rank order: rank r
    holds heads r·h … r·h + h − 1 (vllm/heads.py), so this is every head in order."""
    group = _tp_cpu_group()
    local = local.contiguous()
    parts = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=1)


class ChunkSaver:
    """The worker's half: each ingestion request's chunk KV, read off the paged cache layer by
    layer, then stored as one blob. `layers`: the model's; `num_blocks`: the KV cache's."""

    def __init__(self, store: KVStore | None, *, block_size: int, layers: int,
                 num_blocks: int | None = None):
        self._store = store
        self._block_size = block_size
        self._layers = layers
        self._num_blocks = num_blocks
        self._layouts: dict[tuple, BlockLayout] = {}
        self._saving: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def save_layer(self, meta: TurboRAGConnectorMetadata, index: int, layer_name: str, layer,
                   kv_layer: torch.Tensor) -> None:
        """Copy layer `index`'s keys and values of each ingestion request's chunk off the paged
        cache (this step's tokens are in it already: vLLM writes the cache before attention)."""
        try:
            layout = self._layout(layer, kv_layer)
        except UnreadableCacheLayout as exc:
            log.warning("TurboRAG: no blob saved from layer %s: %s", layer_name, exc)
            return
        for save in meta.saves:
            plan = save.plan
            self._saving.setdefault(save.req_id, {})[index] = tuple(
                t.cpu() for t in layout.read(kv_layer, save.block_ids, plan.anchor_len,
                                             plan.prompt_len))

    def _layout(self, layer, kv_cache: torch.Tensor) -> BlockLayout:
        """The backend's block layout, probed once per cache shape (layout.py)."""
        heads, head_size = int(layer.num_kv_heads), int(layer.head_size)
        key = (type(layer.impl), getattr(layer, "isa", None), tuple(kv_cache.shape[1:]),
               kv_cache.dtype, heads, head_size)
        layout = self._layouts.get(key)
        if layout is None:
            if self._num_blocks and kv_cache.shape[0] != self._num_blocks:
                # the probe writes one block of a cache indexed by block first (vLLM's logical
                # per-layer view); anything else is not ours to write into, even as scratch
                raise UnreadableCacheLayout(
                    f"the cache of shape {tuple(kv_cache.shape)} is not indexed by its "
                    f"{self._num_blocks} blocks first")

            def write(k, v, cache, slots):
                layer.impl.do_kv_cache_update(layer, k, v, cache, slots)

            layout = self._layouts[key] = probe_layout(write, kv_cache, heads, head_size,
                                                       self._block_size)
        return layout

    def store_blobs(self, meta: TurboRAGConnectorMetadata, rank: int, ranks: int) -> None:
        """Store the blobs of the chunks read in this step: a full disk or a missing layer
        costs that blob (logged; the request's response says it was not stored), never the
        step."""
        saving, self._saving = self._saving, {}
        for save in meta.saves:
            plan, layers = save.plan, saving.get(save.req_id, {})
            try:
                complete = sorted(layers) == list(range(self._layers))
                if ranks > 1:  # every rank takes the same path: the gathers below pair up
                    complete = _on_every_rank(complete)
                if not complete:
                    raise RuntimeError(f"{len(layers)} of the model's {self._layers} layers "
                                       "were read (on this rank or another)")
                keys = torch.stack([layers[i][0] for i in range(self._layers)])
                values = torch.stack([layers[i][1] for i in range(self._layers)])
                if ranks > 1:  # each rank read its slice of the heads: rank 0 stores them all
                    keys, values = _gather_heads(keys), _gather_heads(values)
                    if rank != 0:
                        continue
                if self._store is None:
                    raise RuntimeError("this worker could not open the store")
                blob = KVBlob(token_ids=torch.tensor(plan.chunk_ids, dtype=torch.long),
                              keys=keys, values=values,
                              fingerprint=(meta.chunk_fp.with_encoding(plan.lead)
                                           if plan.lead else meta.chunk_fp),
                              base_position=plan.anchor_len)
                self._store.namespace(plan.namespace).put(blob, doc_id=plan.doc_id,
                                                          replace=plan.replace)
            except Exception as exc:
                log.warning("TurboRAG: the chunk of request %s was not stored: %s",
                            save.req_id, exc)
