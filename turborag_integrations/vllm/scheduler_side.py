"""The connector's scheduler side: which prompt tokens a request's stored blobs supply.

`get_num_new_matched_tokens`: a request that opts in through its `cache_salt` (see below) is
searched for stored blobs by its prompt token ids (core/prefill/token_spans.py); the run
`[head][chunk]…[chunk]` that starts the prompt is claimed (claim.py) and vLLM computes the
rest — the question — attending to all of it, then decodes. `build_connector_meta` hands each
claim to the workers (worker_side.py) with the blocks vLLM gave it.

Isolation: vLLM files every computed block in its prefix cache under the hash of the tokens and
the request's `cache_salt`. Stitched KV differs from a causal prefill of the same tokens, so it
must never serve a request that expects the causal one. The scheduler therefore claims only for
requests whose `cache_salt` starts with the configured `salt_prefix` ("turborag" by default):
their blocks are hashed apart from every plain request's, and a plain request never sees a
stitched block. The rest of the salt names the store namespace (a tenant) whose blobs the
request may use (`salt_namespace`): "turborag" the default namespace, "turborag:TENANT" a
tenant's, "turborag:TENANT:SALT" a tenant's cache split further, as `turborag serve` splits it;
blobs of the public namespace too, unless "public" is false in the extra config. vLLM cannot tell
who sent a salt: behind a gateway that sets it per tenant, or with salts as secret as vLLM asks
them to be, no request reaches another tenant's blobs.

The scheduler reads the blobs' fingerprints from the model's checkpoint folder, exactly as the
HF engine that ingested them computes them from the loaded model (model_setup.py,
core/checkpoint.py). It loads an HF copy of the model (CPU) only when it must encode a prompt
head — the text before the first chunk, a causal prefill of which is exact — or a stock
separator that nobody stored yet: a store that holds them keeps the model out of the scheduler.
Ingestion requests are the save role's (save_side.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from cachetools import LRUCache

from ..core.kv.blob import Fingerprint
from ..core.prefill.chunk_encoder import chunk_encoding
from ..core.prefill.token_spans import SpanEntry, TokenSpanIndex, non_overlapping
from ..core.store import KVStore
from ..core.store.namespaces import readable
from .claim import Claim, plan_claim, recovery_refusal, salt_namespace
from .config import ConnectorConfig
from .ingest import wants_ingest
from .metadata import LoadRequest, TurboRAGConnectorMetadata
from .model_setup import ModelSetup
from .save_side import Ingestions

log = logging.getLogger("turborag.vllm")

MAX_SPACES = 1024  # namespaces whose span index the scheduler keeps


def turned_off(reason: str) -> None:
    """Say once why this connector serves every request causally."""
    log.warning("TurboRAG is off: %s. vLLM computes every request itself.", reason)


@dataclass
class Space:
    """The scheduler's view of one store namespace: its store and its span index."""

    store: KVStore
    index: TokenSpanIndex
    refreshed: float = 0.0


class TurboRAGConnectorScheduler:
    """The scheduler process's claims. `store`: None, with `off_reason`, where the connector
    could not start (every request is then vLLM's own); `model`, `dtype`: what vLLM serves (the
    blobs' fingerprints are read from its checkpoint); `ingests`: kv_both (or kv_producer),
    ingestion requests are saved as blobs, `kv_role` naming the role in refusals."""

    def __init__(self, config: ConnectorConfig, store: KVStore | None, *, model: str,
                 dtype: torch.dtype | str, ingests: bool = False,
                 kv_role: str = "kv_consumer", off_reason: str = ""):
        self._config = config
        self._store = store
        self.enabled = store is not None and not off_reason
        self.off_reason = off_reason
        self.setup: ModelSetup | None = None
        self.chunk_fp: Fingerprint | None = None
        self.prefix_fp: Fingerprint | None = None
        self._default_space: Space | None = None  # never let go
        self._spaces: LRUCache[str, Space] = LRUCache(MAX_SPACES - 1)  # the other namespaces
        # req_id -> (claim, first token, namespaces)
        self._pending: dict[str, tuple[Claim, int, tuple[str, ...]]] = {}
        self._claims: dict[str, Claim] = {}
        self._named: dict[str, dict] = {}  # req_id -> counts of the chunks it named
        # req_id -> (why its recovery cannot run, tokens vLLM's own prefix cache held)
        self._refused: dict[str, tuple[str, int]] = {}
        if self.enabled:
            self._start(model, dtype)
        if ingests and self.enabled and self.setup.learned is not None:
            raise ValueError(
                f"TurboRAGConnector: kv_role {kv_role!r} saves chunk blobs, but the "
                f"configured encoder is the learned one ({self.setup.learned.name}): its "
                "soft tokens and encode-only LoRA are not in the weights vLLM runs, so "
                "vLLM's prefill cannot make its blobs. Set \"encoder\": \"none\" in "
                "kv_connector_extra_config (training-free blobs, with or without an "
                "anchor), or ingest with the HF engine and run vLLM as kv_consumer.")
        if not ingests:
            refusal = (f"this vLLM's connector runs as {kv_role!r}: ingestion needs "
                       '"kv_role": "kv_both"')
        else:
            refusal = "" if self.enabled else f"TurboRAG is off in this vLLM: {self.off_reason}"
        self._ingestions = Ingestions(store, self.setup, self.chunk_fp,
                                      salt_prefix=config.salt_prefix, refusal=refusal)

    def _off(self, reason: str) -> None:
        self.enabled = False
        self.off_reason = reason
        turned_off(reason)

    def _start(self, model: str, dtype: torch.dtype | str) -> None:
        try:
            # blobs are made once, in one dtype (float32 on a CPU at ingestion), and may
            # serve a worker of another: the worker casts them to its cache's dtype
            self.setup = ModelSetup(model, self._config.blob_dtype or dtype, self._config,
                                    self._store)
            self.chunk_fp = self.setup.chunk_fp
            self.prefix_fp = self.setup.prefix_fp
            self._space("")
        except Exception as exc:  # a model the HF engine cannot load, a store that fails
            self._off(f"the model's blobs cannot be indexed: {type(exc).__name__}: {exc}")

    # ---- the store's namespaces ---------------------------------------------------------------
    def _space(self, namespace: str) -> Space:
        """A namespace's index, made (blobs indexed) on first sight; beyond MAX_SPACES the
        least recently used ones other than the default are dropped (per-user salts make
        many), to be made again if their namespace comes back. The stock separators are stored once, in the default
        namespace: they are the same constants for everyone and hold nobody's data."""
        if not namespace:
            if self._default_space is None:
                self._store_separators()
                self._default_space = self._new_space("")
            return self._default_space
        space = self._spaces.get(namespace)
        if space is None:
            space = self._spaces[namespace] = self._new_space(namespace)
        return space

    def _new_space(self, namespace: str) -> Space:
        space = Space(self._store.namespace(namespace),
                      TokenSpanIndex(self._config.min_chunk_tokens))
        self._refresh(space, force=True)
        return space

    def _store_separators(self) -> None:
        """Have the stock separators' blobs in the default namespace (the claim crosses them from
        one chunk to the next); the HF model computes them only if one is missing."""
        store = self._store.namespace("")
        if not all(store.contains(store.key(self.chunk_fp, ids))
                   for ids in self.setup.separator_ids()):
            self.setup.engine.library.encode_separators()

    def _refresh(self, space: Space, force: bool = False) -> None:
        """Index the blobs stored in a namespace since the last look (other processes ingest
        into the store)."""
        now = time.monotonic()
        if not force and now - space.refreshed < self._config.refresh_s:
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

    def _namespaces(self, request) -> tuple[str, ...] | None:
        """The namespaces whose blobs a request may use, its own first (then, for a salted
        one, its tenant's, and the public one: `namespaces.readable`); None: not ours."""
        namespace = salt_namespace(request.cache_salt, self._config.salt_prefix)
        if namespace is None:
            return None
        return readable(namespace, self._config.public)

    # ---- the blobs a claim is made of ---------------------------------------------------------
    def _head_key(self, space: Space, ids) -> str | None:
        """The stored head blob of `ids` in a namespace, encoded now if missing and short
        enough: heads are few (one per template and system prompt), so each is computed once,
        on first sight."""
        ids = list(ids)
        store = space.store
        key = store.key(self.prefix_fp, ids)
        if store.contains(key):
            return key
        if len(ids) > self._config.max_head_tokens:
            return None
        try:
            [blob] = self.setup.engine.library.prefix_encoder.encode_ids([ids])
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

    def _separator_key(self, ids) -> str | None:
        store = self._store.namespace("")  # where they are stored
        key = store.key(self.chunk_fp, list(ids))
        return key if store.contains(key) else None

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
                ids = self.setup.tokenize_chunk(text) if isinstance(text, str) else None
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

    # ---- vLLM's scheduler hooks ---------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = getattr(request, "kv_transfer_params", None)
        if wants_ingest(params):
            # an ingestion request is computed, never claimed: its blob must be vLLM's prefill
            self._ingestions.plan(request, params)
            return 0, False
        namespaces = self._namespaces(request) if self.enabled else None
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

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._pending.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output) -> TurboRAGConnectorMetadata:
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
            self._ingestions.schedule_saves(meta, scheduler_output)
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict | None]:
        ingested = self._ingestions.finished(request.request_id)
        if ingested is not None:
            return False, {"turborag": {"ingest": ingested}}
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
