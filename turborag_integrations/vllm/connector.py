"""TurboRAG as a KV connector of stock vLLM: stitched chunk caches fed into vLLM's paged cache.

    python -m vllm.entrypoints.openai.api_server --model MODEL_DIR --dtype float32 \\
        --kv-transfer-config '{"kv_connector": "TurboRAGConnector",
            "kv_connector_module_path": "turborag_integrations.vllm.connector",
            "kv_role": "kv_consumer",
            "kv_connector_extra_config": {"store": "/path/to/store"}}'

Scheduler side (`get_num_new_matched_tokens`): a request that opts in through its `cache_salt`
(see below) is searched for stored blobs by its prompt token ids (core/prefill/token_spans.py);
the run `[head][chunk]…[chunk]` that starts the prompt is claimed (claim.py) and vLLM computes
the rest — the question — attending to all of it, then decodes.

Worker side (`start_load_kv`): each claimed blob is read from the store, its fingerprint checked,
its keys re-rotated to where it sits in the prompt, and every layer's keys and values written
into the request's blocks through the attention backend's own cache write
(`impl.do_kv_cache_update`), so the cache layout is the backend's business. A blob that cannot be
read is reported through `get_block_ids_with_load_errors`, and vLLM recomputes those blocks.

Isolation: vLLM files every computed block in its prefix cache under the hash of the tokens and
the request's `cache_salt`. Stitched KV differs from a causal prefill of the same tokens, so it
must never serve a request that expects the causal one. The connector therefore claims only for
requests whose `cache_salt` starts with the configured `salt_prefix` ("turborag" by default):
their blocks are hashed apart from every plain request's, and a plain request never sees a
stitched block. The rest of the salt names the store namespace (a tenant) whose blobs the
request may use (`salt_namespace`): "turborag" the default namespace, "turborag:TENANT" a
tenant's, "turborag:TENANT:SALT" a tenant's cache split further, as `turborag serve` splits it;
blobs of the public namespace too, unless "public" is false in the extra config. vLLM cannot tell
who sent a salt: behind a gateway that sets it per tenant, or with salts as secret as vLLM asks
them to be, no request reaches another tenant's blobs.

Extra config keys: "store" (a store folder or a redis:// URL, as KVStore takes; required),
"min_chunk_tokens" (shortest blob the finder indexes, default 8), "salt_prefix", "encoder",
"anchor" and "context_tokens" (as TurboRAGEngine takes them: the blobs' encoding must be the one
they were made with),
"refresh_s" (how often the scheduler looks for newly stored blobs, default 2), "public"
(requests may also use blobs of the public namespace, default true), "store_dir" (the
local disk tier in front of a redis:// store), "max_head_tokens" (longest prompt head the
scheduler encodes itself when none is stored, default 512), "blob_dtype" (the dtype the blobs
were encoded in, when it is not vLLM's: float32 blobs serve a bfloat16 worker, cast as they are
written).

The scheduler reads the blobs' fingerprints from the model's checkpoint folder, exactly as the
HF engine that ingested them computes them from the loaded model (model_setup.py,
core/checkpoint.py). It loads an HF copy of the model (CPU) only when it must encode a prompt
head — the text before the first chunk, a causal prefill of which is exact — or a stock
separator that nobody stored yet: a store that holds them keeps the model out of the scheduler.

Save side (ingestion, `"kv_role": "kv_both"`): a request whose `kv_transfer_params` holds
`"turborag_ingest": true` and whose prompt is the anchor's token ids then a chunk's (ingest.py)
is prefilled by vLLM like any other; in the step that completes its prompt the scheduler sends
its block ids, `save_kv_layer` reads every layer's keys and values of the chunk's positions off
the paged cache (layout.py: the layout is learned from the backend's own cache write) and
`wait_for_save` stores them as the blob `ChunkEncoder` makes — same fingerprint, encoding,
base_position and key. Prefix-cache hits are read like computed blocks: they hold the causal KV
of the same tokens. Under tensor parallelism each rank reads its own KV heads and rank 0
stores them gathered. Training-free encodings only, in the model's dtype, with the KV heads
split evenly over the tensor-parallel ranks of one pipeline stage: anything else is refused at
startup (`_check_save_support`).
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from ..core.kv.blob import Fingerprint, KVBlob
from ..core.prefill.chunk_encoder import chunk_encoding
from ..core.prefill.rope import KeyRotator
from ..core.prefill.token_spans import SpanEntry, TokenSpanIndex
from ..core.prefill.token_spans import non_overlapping
from ..core.store import KVStore
from ..core.store.namespaces import readable
from .claim import Claim, ClaimedSpan, plan_claim, recovery_refusal, salt_namespace
from .heads import rank_heads
from .ingest import IngestPlan, IngestRequestError, plan_ingest, wants_ingest
from .layout import BlockLayout, UnreadableCacheLayout, probe_layout
from .metrics import TurboRAGConnectorStats, TurboRAGPromMetrics
from .model_setup import ModelSetup

log = logging.getLogger("turborag.vllm")

_LAYER = re.compile(r"layers\.(\d+)\.")
MAX_SPACES = 1024  # namespaces whose span index the scheduler keeps


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


@dataclass
class Space:
    """The scheduler's view of one store namespace: its store and its span index."""

    store: Any
    index: TokenSpanIndex
    refreshed: float = 0.0




@dataclass
class TurboRAGConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadRequest] = field(default_factory=list)
    saves: list[SaveRequest] = field(default_factory=list)
    chunk_fp: Fingerprint | None = None
    prefix_fp: Fingerprint | None = None


def open_store(spec: str, *, memory_bytes: int, store_dir: str | None = None) -> KVStore:
    """A store folder, or a redis:// URL (a Redis tier behind a local disk tier in `store_dir`,
    by default the package's store folder)."""
    spec = str(spec)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return KVStore(store_dir, remote_url=spec, memory_bytes=memory_bytes)
    return KVStore(spec, remote_url="", memory_bytes=memory_bytes)


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


def _check_save_support(vllm_config, extra: dict) -> None:
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
    if extra.get("blob_dtype") and str(extra["blob_dtype"]).replace("torch.", "") != dtype:
        raise ValueError(f"TurboRAGConnector saves blobs in vLLM's dtype ({dtype}), not in "
                         f"blob_dtype {extra['blob_dtype']!r}: drop blob_dtype, or run vLLM in "
                         f"{extra['blob_dtype']} to ingest")


class TurboRAGConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        extra = dict(cfg.kv_connector_extra_config or {})
        if not extra.get("store"):
            raise ValueError('TurboRAGConnector needs kv_connector_extra_config {"store": '
                             '"<store folder or redis:// URL>"}: where the chunk blobs are')
        self._block_size = vllm_config.cache_config.block_size
        self._salt_prefix = str(extra.get("salt_prefix", "turborag"))
        self._enabled = True
        self._store = None
        if getattr(cfg, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning('TurboRAG: kv_load_failure_policy is %r: a blob that cannot be read at '
                        'load time fails its request; set "kv_load_failure_policy": "recompute" '
                        'to have vLLM compute those tokens instead', cfg.kv_load_failure_policy)
        model_config = vllm_config.model_config
        try:
            self._rotator = KeyRotator.for_config(model_config.hf_config)
        except Exception as exc:  # UnsupportedRopeError, or a config we cannot read
            self._off(f"its RoPE cannot be re-rotated: {exc}")
        if self._enabled:
            try:
                # the scheduler reads blobs only to learn their token ids: no RAM tier to fill
                self._store = open_store(
                    extra["store"], store_dir=extra.get("store_dir"),
                    memory_bytes=0 if role == KVConnectorRole.SCHEDULER else 1 << 30)
            except Exception as exc:  # an unwritable folder, a refused connection
                self._off(f"the store {extra['store']!r} cannot be opened: {exc}")
        self.chunk_fp = self.prefix_fp = None
        self._setup: ModelSetup | None = None
        self._public = bool(extra.get("public", True))
        self._off_reason = ""
        # kv_both (or kv_producer): ingestion requests are saved as blobs
        self._ingests = bool(getattr(cfg, "is_kv_producer", False))
        if self._ingests:
            _check_save_support(vllm_config, extra)
        if role == KVConnectorRole.SCHEDULER:
            self._min_tokens = int(extra.get("min_chunk_tokens", 8))
            self._spaces: OrderedDict[str, Space] = OrderedDict()
            self._refresh_s = float(extra.get("refresh_s", 2.0))
            self._pending: dict[str, tuple[Claim, int]] = {}  # req_id -> (claim, first token)
            self._claims: dict[str, Claim] = {}
            self._named: dict[str, dict] = {}  # req_id -> counts of the chunks it named
            # req_id -> (why its recovery cannot run, tokens vLLM's own prefix cache held)
            self._refused: dict[str, tuple[str, int]] = {}
            self._max_head = int(extra.get("max_head_tokens", 512))
            self._ingestions: dict[str, Ingestion] = {}
            if self._enabled:
                self._start_scheduler(model_config, extra)
            if self._ingests and self._enabled and self._setup.learned is not None:
                raise ValueError(
                    f"TurboRAGConnector: kv_role {cfg.kv_role!r} saves chunk blobs, but the "
                    f"configured encoder is the learned one ({self._setup.learned.name}): its "
                    "soft tokens and encode-only LoRA are not in the weights vLLM runs, so "
                    "vLLM's prefill cannot make its blobs. Set \"encoder\": \"none\" in "
                    "kv_connector_extra_config (training-free blobs, with or without an "
                    "anchor), or ingest with the HF engine and run vLLM as kv_consumer.")
        else:
            self._tp: tuple[int, int] | None = None  # (rank, ranks), read at the first load
            self._load_errors: set[int] = set()
            self._stats = TurboRAGConnectorStats()  # since vLLM last collected them
            self._layers = int(getattr(model_config.hf_config, "num_hidden_layers", 0))
            self._layouts: dict[tuple, BlockLayout] = {}
            self._num_blocks = getattr(kv_cache_config, "num_blocks", None)
            self._saving: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def _off(self, reason: str) -> None:
        """Serve every request causally, and say why once."""
        self._enabled = False
        self._off_reason = reason
        log.warning("TurboRAG is off: %s. vLLM computes every request itself.", reason)

    def _start_scheduler(self, model_config, extra: dict) -> None:
        try:
            # blobs are made once, in one dtype (float32 on a CPU at ingestion), and may
            # serve a worker of another: the worker casts them to its cache's dtype
            blob_dtype = extra.get("blob_dtype") or model_config.dtype
            self._setup = ModelSetup(model_config.model, blob_dtype, extra, self._store)
            self.chunk_fp = self._setup.chunk_fp
            self.prefix_fp = self._setup.prefix_fp
            self._space("")
        except Exception as exc:  # a model the HF engine cannot load, a store that fails
            self._off(f"the model's blobs cannot be indexed: {type(exc).__name__}: {exc}")

    def _space(self, namespace: str) -> Space:
        """A namespace's index, made (blobs indexed) on first sight; the least recently used
        ones are dropped beyond MAX_SPACES (per-user salts make many), to be made again if
        their namespace comes back. The stock separators are stored once, in the default
        namespace: they are the same constants for everyone and hold nobody's data."""
        space = self._spaces.get(namespace)
        if space is None:
            if not namespace:
                self._store_separators()
            space = self._spaces[namespace] = Space(self._store.namespace(namespace),
                                                    TokenSpanIndex(self._min_tokens))
            self._refresh(space, force=True)
            while len(self._spaces) > MAX_SPACES:
                oldest = next(n for n in self._spaces if n)  # the default one stays
                del self._spaces[oldest]
        else:
            self._spaces.move_to_end(namespace)
        return space

    def _store_separators(self) -> None:
        """Have the stock separators' blobs in the default namespace (the claim crosses them from
        one chunk to the next); the HF model computes them only if one is missing."""
        store = self._store.namespace("")
        if not all(store.contains(store.key(self.chunk_fp, ids))
                   for ids in self._setup.separator_ids()):
            self._setup.engine.encode_separators()

    # ---- scheduler side ---------------------------------------------------------------------
    def _refresh(self, space: Space, force: bool = False) -> None:
        """Index the blobs stored in a namespace since the last look (other processes ingest
        into the store)."""
        now = time.monotonic()
        if not force and now - space.refreshed < self._refresh_s:
            return
        space.refreshed = now
        wanted = {self.chunk_fp.id: False, self.prefix_fp.id: True}
        store = space.store
        new = []
        try:
            keys = store.keys()
        except Exception as exc:  # a remote tier gone: claim what is indexed, look again later
            log.warning("TurboRAG: the store cannot be listed: %s", exc)
            keys = []
        for key in keys:
            if key in space.index:
                continue
            try:
                # the header and token ids only: the first look at a store of a million chunks
                # must not read a million blobs (the worker verifies each one it loads)
                found = store.peek(key)
            except Exception as exc:  # an unreachable tier is a miss, never a failure
                log.debug("blob %s skipped: %s", key[:12], exc)
                continue
            if found is None or found.fingerprint.id not in wanted:
                continue
            new.append(SpanEntry(key, found.token_ids, plain=wanted[found.fingerprint.id]))
        if new:
            space.index.add(new)
            log.info("TurboRAG: %d blobs indexed (%d new)", len(space.index), len(new))

    def _head_key(self, space: Space, ids) -> str | None:
        """The stored head blob of `ids` in a namespace, encoded now if missing and short
        enough: heads are few (one per template and system prompt), so each is computed once,
        on first sight."""
        ids = list(ids)
        store = space.store
        key = store.key(self.prefix_fp, ids)
        if store.contains(key):
            return key
        if len(ids) > self._max_head:
            return None
        try:
            [blob] = self._setup.engine.prefix_encoder.encode_ids([ids])
            store.put(blob, kind="prefix")
        except Exception as exc:  # a full disk costs the reuse, never the request
            log.warning("TurboRAG: prompt head of %d tokens not stored: %s", len(ids), exc)
            return None
        return key

    def _lead_key(self, spaces: list[Space], head, chunk) -> tuple[str, str] | None:
        """(key, encoding) of the chunk's lead blob after this head (encoded right after it,
        as the HF engine does for the prompt heads it is told: core/library.py), in the first
        of the request's namespaces that holds one; None where none does."""
        encoding = chunk_encoding(list(head))
        fp = self.chunk_fp.with_encoding(encoding)
        for space in spaces:
            key = space.store.key(fp, list(chunk))
            if space.store.contains(key):
                return key, encoding
        return None

    def _named_chunks(self, request, spaces: list[Space]) -> dict | None:
        """Chunk texts the client names in `kv_transfer_params.turborag_chunks`: indexed now if
        stored in one of the request's namespaces (no wait for the next look at the store); the
        others are counted, not fatal."""
        params = getattr(request, "kv_transfer_params", None) or {}
        texts = params.get("turborag_chunks") if isinstance(params, dict) else None
        if not isinstance(texts, list):
            return None
        unknown = 0
        for text in texts:
            try:
                ids = self._setup.tokenize_chunk(text) if isinstance(text, str) else None
            except Exception:  # empty, or longer than the window
                ids = None
            found = None
            for space in spaces if ids else ():
                key = space.store.key(self.chunk_fp, ids)
                if space.store.contains(key):
                    found = space, key
                    break
            if found is None:
                unknown += 1
                continue
            space, key = found
            if not space.index.add([SpanEntry(key, tuple(ids))]) and key not in space.index:
                unknown += 1  # shorter than min_chunk_tokens
        return {"named_chunks": len(texts), "unknown_chunks": unknown}

    def _separator_key(self, ids) -> str | None:
        store = self._store.namespace("")  # where they are stored
        key = store.key(self.chunk_fp, list(ids))
        return key if store.contains(key) else None

    def _namespaces(self, request) -> tuple[str, ...] | None:
        """The namespaces whose blobs a request may use, its own first (then, for a salted
        one, its tenant's, and the public one: `namespaces.readable`); None: not ours."""
        namespace = salt_namespace(request.cache_salt, self._salt_prefix)
        if namespace is None:
            return None
        return readable(namespace, self._public)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = getattr(request, "kv_transfer_params", None)
        if wants_ingest(params):
            # an ingestion request is computed, never claimed: its blob must be vLLM's prefill
            self._ingestions[request.request_id] = self._plan_ingestion(request, params)
            return 0, False
        namespaces = self._namespaces(request) if self._enabled else None
        if namespaces is None:
            return 0, False
        refusal = recovery_refusal(params)
        if refusal is not None:  # never silently stitched: prefilled whole, and told why
            if request.request_id not in self._refused:
                log.warning("TurboRAG: request %s: %s", request.request_id, refusal)
            # a local hit under this salt may be KV stitched for an earlier request: reported,
            # since the connector cannot stop vLLM from reusing it (skip_reading_prefix_cache can)
            skipped = getattr(request, "skip_reading_prefix_cache", False)
            cached = 0 if skipped else num_computed_tokens
            self._refused[request.request_id] = (refusal, cached)
            return 0, False
        spaces = [self._space(n) for n in namespaces]
        own = spaces[0]
        for space in spaces:
            self._refresh(space)
        named = self._named_chunks(request, spaces)
        ids = list(request.prompt_token_ids or [])
        # a blob deleted since it was indexed ends the claim there (contains: one stat per span)
        matches = []
        for space in spaces:
            for match in space.index.find(ids):
                if match.entry.plain and space is not own:
                    continue  # a head computed for requests of another namespace: never shared
                if space.store.contains(match.entry.key):
                    matches.append(match)
                else:
                    space.index.discard(match.entry.key)
        claim = plan_claim(ids, non_overlapping(matches), lambda i: self._head_key(own, i),
                           self._separator_key,
                           lead_key=lambda head, chunk: self._lead_key(spaces, head, chunk))
        self._claims[request.request_id] = claim
        if named is not None:
            self._named[request.request_id] = named
        if claim.end <= num_computed_tokens:
            return 0, False
        self._pending[request.request_id] = (claim, num_computed_tokens, namespaces)
        return claim.end - num_computed_tokens, False

    def _plan_ingestion(self, request, params: dict) -> Ingestion:
        if not self._ingests:
            role = self._kv_transfer_config.kv_role
            return Ingestion(error=f"this vLLM's connector runs as {role!r}: ingestion needs "
                                   '"kv_role": "kv_both"')
        if not self._enabled:
            return Ingestion(error=f"TurboRAG is off in this vLLM: {self._off_reason}")
        try:
            plan = plan_ingest(params, request.prompt_token_ids or [], self._setup.anchor_ids,
                               max_chunk_tokens=self._setup.max_chunk_tokens,
                               salt=request.cache_salt, salt_prefix=self._salt_prefix,
                               context_tokens=self._setup.context_tokens)
        except IngestRequestError as exc:
            return Ingestion(error=str(exc))
        store = self._store.namespace(plan.namespace)
        # a lead blob is keyed by its head's encoding, as the HF engine's (core/library.py)
        fp = self.chunk_fp.with_encoding(plan.lead) if plan.lead else self.chunk_fp
        key = store.key(fp, plan.chunk_ids)
        existing = store.contains(key)
        alone = len(self._setup.anchor_ids)  # ingestion runs only without soft tokens
        if existing and plan.anchor_len > alone and not plan.lead:
            # as encode_chunks does: a blob encoded alone (at query time, by an HF engine on
            # the same store) gives way to this one, encoded after its document's context
            if store.base_position(key) == alone:
                existing, plan = False, replace(plan, replace=True)
        if existing and plan.doc_id:
            store.add_ref(key, plan.doc_id)  # as encode_chunks records a chunk stored before
        return Ingestion(plan, key, existing=existing)

    def _ingestion_result(self, ingestion: Ingestion) -> dict:
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

    def _schedule_saves(self, meta: TurboRAGConnectorMetadata, scheduler_output) -> None:
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
            ingestion = self._ingestions.get(req_id)
            if ingestion is None or not ingestion.wanted:
                continue
            if block_ids is not None:
                new_blocks = list(block_ids[0])
                ingestion.block_ids = ingestion.block_ids + new_blocks if append else new_blocks
            if computed + scheduled.get(req_id, 0) >= ingestion.plan.prompt_len:
                meta.saves.append(SaveRequest(req_id, ingestion.plan, list(ingestion.block_ids)))
                ingestion.sent = True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens == 0:
            self._pending.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = TurboRAGConnectorMetadata(chunk_fp=self.chunk_fp, prefix_fp=self.prefix_fp)
        for new in scheduler_output.scheduled_new_reqs:
            entry = self._pending.pop(new.req_id, None)
            if entry is not None:
                claim, first, namespaces = entry
                meta.loads.append(LoadRequest(new.req_id, claim.spans, first,
                                              list(new.block_ids[0]), namespaces))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # a preempted request that resumes was matched again: its blocks are new
            if req_id in self._pending and req_id in cached.resumed_req_ids:
                claim, first, namespaces = self._pending.pop(req_id)
                block_ids = cached.new_block_ids[i]
                if block_ids is not None:
                    meta.loads.append(LoadRequest(req_id, claim.spans, first, list(block_ids[0]),
                                                  namespaces))
        if self._ingestions:
            self._schedule_saves(meta, scheduler_output)
        return meta

    def request_finished(self, request, block_ids):
        ingestion = self._ingestions.pop(request.request_id, None)
        if ingestion is not None:
            return False, {"turborag": {"ingest": self._ingestion_result(ingestion)}}
        claim = self._claims.pop(request.request_id, None)
        self._pending.pop(request.request_id, None)
        named = self._named.pop(request.request_id, None) or {}
        refused = self._refused.pop(request.request_id, None)
        if refused is not None:
            why, cached = refused
            return False, {"turborag": {"claimed_tokens": 0, "recovery_refused": why,
                                        "prefix_cached_tokens": cached}}
        if claim is None:
            return False, None
        return False, {"turborag": {"claimed_tokens": claim.end,
                                    "chunk_tokens": claim.chunk_tokens,
                                    "spans": len(claim.spans),
                                    "separators": sum(s.separator for s in claim.spans),
                                    "lead_blob": any(s.lead for s in claim.spans),
                                    **named}}

    # ---- worker side ------------------------------------------------------------------------
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
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
        """(this worker's tensor-parallel rank, the number of ranks), read once."""
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
        self._stats.record(written, spans, errors, time.perf_counter() - started)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        """Copy this layer's keys and values of each ingestion request's chunk off the paged
        cache (this step's tokens are in it already: vLLM writes the cache before attention)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, TurboRAGConnectorMetadata) or not meta.saves:
            return
        m = _LAYER.search(layer_name)
        if m is None:
            return
        from vllm.forward_context import get_forward_context

        layer = get_forward_context().no_compile_layers[layer_name]
        try:
            layout = self._layout(layer, kv_layer)
        except UnreadableCacheLayout as exc:
            log.warning("TurboRAG: no blob saved from layer %s: %s", layer_name, exc)
            return
        for save in meta.saves:
            plan = save.plan
            self._saving.setdefault(save.req_id, {})[int(m.group(1))] = tuple(
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

    def wait_for_save(self):
        """Store the blobs of the chunks read in this step: a full disk or a missing layer
        costs that blob (logged; the request's response says it was not stored), never the
        step."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, TurboRAGConnectorMetadata) or not meta.saves:
            return
        saving, self._saving = self._saving, {}
        rank, ranks = self._ranks()
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

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- statistics (metrics.py) --------------------------------------------------------------
    def get_kv_connector_stats(self) -> TurboRAGConnectorStats | None:
        stats = getattr(self, "_stats", None)  # the scheduler's side has none
        if stats is None or stats.is_empty():
            return None
        self._stats = TurboRAGConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> TurboRAGConnectorStats:
        return TurboRAGConnectorStats(data=data) if data is not None else TurboRAGConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return TurboRAGPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
