"""KVStore: the ordered tiers of core/store/ behind one put / get / delete (package docstring)."""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

import torch
from cachetools import LRUCache

from .. import environment
from ..errors import BlobCorrupted, TurboRAGError
from ..kv.blob import Fingerprint, KVBlob, chunk_key, namespace_tag
from ..settings import with_fields
from . import maintenance
from .budget import parse_size
from .config import StoreConfig, default_store_path
from .disk import KINDS, DiskTier
from .format import BlobSummary
from .memory import MemoryTier
from .stats import StoreStats
from .namespaces import check_namespace, disk_partition, key_in_namespace, namespace_root
from .tier import Tier, owned_copy

log = logging.getLogger(__name__)

__all__ = ["KVStore", "StoreClosedError"]


class StoreClosedError(TurboRAGError, RuntimeError):
    """A KVStore was used after close()."""


class KVStore:
    """Durable, content-addressed storage of KV blobs.

    Configured by a `StoreConfig` (`config=`) or its fields by name: disk_bytes bounds the disk tier and prefix_bytes its prefix blobs (ints or sizes such as
    "20GB"; None: $TURBORAG_STORE_BYTES / $TURBORAG_STORE_PREFIX_BYTES, else half the room on
    the store's file system up to 100 GiB, and a tenth of that up to 8 GiB; see `.budget`).
    memory_bytes bounds the RAM tier (0 disables it); accelerator_bytes, when CUDA is available,
    adds a tier in GPU memory in front of it. storage_dtype is how blobs are written: "native"
    (the model's dtype, exact), "bfloat16"/"float16", or "int8" (KIVI-style, about a quarter of
    float32); any of them decodes to the model's dtype on load. `remote_url` (None:
    $TURBORAG_REDIS_URL; "" for none) adds a Redis tier after the disk tier, with the defaults of
    `.redis_tier.RedisTier` (build one yourself and pass it in `tiers` to change them); it needs
    the `redis` extra. `tiers` are further tiers (see `.tier.Tier`), looked up after those in the
    order given.

    Close the store (or use it as a context manager) to stop its prefetch threads and release
    its tiers; closing twice is harmless. After close, get, put, contains, delete, delete_doc,
    keys and prefetch raise StoreClosedError.
    """

    MAX_SALTED = 4096  # salted namespaces' stores kept at once (`namespace`); a few kB each

    def __init__(self, root: str | os.PathLike | None = None, *,
                 config: StoreConfig | None = None, tiers: Iterable[Tier] = (), **settings):
        namespace = ""  # the store's own; `namespace(name)` opens (and checks) the others
        self.config = c = with_fields(config or StoreConfig(), "KV store", **settings)
        self.base = Path(root or default_store_path()).expanduser()
        self.disk = DiskTier(namespace_root(self.base, namespace), c.storage_dtype,
                             max_bytes=c.disk_bytes, prefix_bytes=c.prefix_bytes)
        self.memory = MemoryTier(c.memory_bytes) if c.memory_bytes > 0 else None
        self.accelerator = (MemoryTier(c.accelerator_bytes, device="cuda")
                            if c.accelerator_bytes > 0 and torch.cuda.is_available() else None)
        extra = list(tiers)
        url = environment.redis_url() if c.remote_url is None else c.remote_url
        if url:
            from .redis_tier import RedisTier  # imported on demand: redis-py is an extra

            extra.insert(0, RedisTier(url, storage_dtype=c.storage_dtype))
        for tier in extra:
            if not isinstance(tier, Tier):
                raise TypeError(f"{tier!r} does not keep the tier contract of "
                                f"{Tier.__module__}.Tier")
        self._setup(namespace, (self.accelerator, self.memory, self.disk, *extra),
                    c.prefetch_threads, (c.disk_bytes, c.prefix_bytes))

    def _setup(self, namespace: str, tiers, prefetch_threads: int, budgets) -> None:
        self.namespace_name = namespace
        self._tag = namespace_tag(namespace)
        self.tiers: tuple[Tier, ...] = tuple(t for t in tiers if t is not None)
        self._disk_depth = self.tiers.index(self.disk)
        self._budgets = budgets
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._prefetch_threads = prefetch_threads
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._children: dict[str, KVStore] = {}  # namespaces with a disk tier of their own
        self._salted: LRUCache[str, KVStore] = LRUCache(self.MAX_SALTED)
        self._parent: KVStore | None = None
        self._owns_disk = True

    # ---- namespaces -------------------------------------------------------------------------
    def namespace(self, name: str) -> "KVStore":
        """The store of namespace `name` (a tenant): its own disk tier under
        `<root>/namespaces/<tag>` with the same budgets, its own keys (`key`), and the memory,
        accelerator and remote tiers of this store, in which it sees only its own keys (see
        `namespaces.py`). The same object for the same name; "" is the default namespace. A
        salted namespace ("tenant/salt", which uses its tenant's disk tier) is the same object
        while among the `MAX_SALTED` most recently asked for; one let go keeps working."""
        check_namespace(name)
        if name == self.namespace_name:
            return self
        if self._parent is not None:
            return self._parent.namespace(name)
        with self._lock:
            if self._closed:
                raise StoreClosedError(f"the KV store at {self.base} is closed")
            # a salted namespace has no disk tier of its own, and is let go when quiet
            kept = self._salted if disk_partition(name) != name else self._children
            child = kept.get(name)
            if child is None:
                child = kept[name] = self._child(name)
        return child

    def _child(self, name: str) -> "KVStore":
        """A namespace's store: every tier of this one but the disk tier (hold self._lock)."""
        child = KVStore.__new__(KVStore)  # built from this store's tiers, not from settings
        child.base, child.config = self.base, self.config
        partition = disk_partition(name)
        if partition == name:
            disk_bytes, prefix_bytes = self._budgets
            child.disk = DiskTier(namespace_root(self.base, name), self.disk.storage_dtype,
                                  max_bytes=disk_bytes, prefix_bytes=prefix_bytes)
        else:  # "tenant/salt": the tenant's disk tier
            owner = self if not partition else self._children.get(partition)
            if owner is None:
                owner = self._children[partition] = self._child(partition)
            child.disk = owner.disk
        child.memory, child.accelerator = self.memory, self.accelerator
        tiers = [child.disk if t is self.disk else t for t in self.tiers]
        child._setup(name, tiers, self._prefetch_threads, self._budgets)
        child._parent = self
        child._owns_disk = partition == name
        return child

    def key(self, fingerprint: Fingerprint, token_ids) -> str:
        """The key of a chunk's blob in this store's namespace."""
        return chunk_key(fingerprint, list(token_ids), self.namespace_name)

    def owns(self, key: str) -> bool:
        """Whether `key` is a key of this store's namespace (by its tag)."""
        return key_in_namespace(key, self._tag)

    @property
    def root(self) -> Path:
        return self.disk.root

    @property
    def storage_dtype(self) -> str:
        return self.disk.storage_dtype

    def _open_tiers(self) -> tuple[Tier, ...]:
        if self._closed:
            raise StoreClosedError(f"the KV store at {self.root} is closed")
        return self.tiers

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats.count(name, n)

    def _count_hit(self, tier: Tier) -> None:
        with self._lock:
            self._stats.count_hit(tier.name)

    # ---- write ------------------------------------------------------------------------------
    def put(self, blob: KVBlob, *, doc_id: str | None = None, kind: str = "chunk",
            replace: bool = False) -> str:
        """Store a blob in every write-through tier (no rewrite where it is already there) and
        record its document. Cache tiers are filled by reads, not here.

        `replace`: write it even where a blob is stored under its key (the same tokens and
        fingerprint, encoded after another context: `ChunkLibrary.encode_chunks`), and drop the
        cache tiers' copies of the old one. The documents recorded for the key stay. A reader
        between the delete and the write misses, as for a blob not yet stored.

        `kind` is "chunk" (a document's chunk, the default) or "prefix" (a prompt head or a
        RAPID document prefix: written per query, so the disk tier bounds them apart, see
        `prefix_bytes`). A blob larger than its bound is not written (a warning says which
        setting to raise); the key is returned all the same. Prefix blobs stay on the local disk
        tier: they are made per query (or are a whole document's KV, hundreds of MB), so
        shipping them to a shared remote tier would cost more than it saves."""
        if kind not in KINDS:
            raise ValueError(f"a blob's kind is one of {KINDS}, not {kind!r}")
        key = self.key(blob.fingerprint, blob.token_ids.tolist())
        for tier in self._open_tiers():
            if replace:
                # each tier keeps an entry's first write (Redis) or counts its bytes (disk):
                # the old entry goes first
                tier.delete(key)
            if kind == "prefix" and tier is not self.disk:
                continue
            if tier.write_through and not tier.contains(key):
                held = self.disk.put(key, blob, kind) if tier is self.disk else tier.put(key, blob)
                if held:
                    self._count("bytes_written", held)
                    self._count("writes")
        if doc_id:
            self.disk.add_ref(key, doc_id)
        return key

    def add_ref(self, key: str, doc_id: str) -> None:
        """Record that document `doc_id` uses the blob under `key`."""
        if self.owns(key):
            self.disk.add_ref(key, doc_id)

    def share_refs(self, key: str, other: str) -> None:
        """Record the documents that use the blob under `key` as users of `other` too (a blob
        made later from the same chunk), so that forgetting them deletes both."""
        if self.owns(key) and self.owns(other):
            self.disk.share_refs(key, other)

    # ---- read -------------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        tiers = self._open_tiers()
        return self.owns(key) and any(tier.contains(key) for tier in tiers)

    def get(self, key: str, fingerprint: Fingerprint | None = None) -> KVBlob | None:
        """The blob under key, or None on a miss; never a blob of another fingerprint.

        Tiers are asked fastest first. A corrupted entry is reported and removed, and the lookup
        goes on in the next tier. A hit is copied into the faster tiers that missed it."""
        tiers = self._open_tiers()
        found = self._find(tiers, key) if self.owns(key) else None
        if found is None:
            self._count("misses")
            return None
        depth, blob = found
        if fingerprint is not None and blob.fingerprint.id != fingerprint.id:
            log.warning("KV blob %s belongs to %s, not %s; ignoring it", key,
                        blob.fingerprint.describe(), fingerprint.describe())
            self._count("fingerprint_rejects")
            self._count("misses")
            return None
        source = tiers[depth]
        self._count_hit(source)
        if depth < self._disk_depth:
            self.disk.note_read(key)  # a cache hit is a use the disk tier's eviction must see
        faster = tiers[:depth]
        if faster and source.lends_views:
            # A view of a memory map is the page cache's, not ours to keep: a cache tier must
            # own its bytes, or evicted pages would be re-read from disk on a "hit".
            blob = owned_copy(blob)
        for tier in faster:
            self._promote(tier, key, blob)
        return blob

    def peek(self, key: str) -> BlobSummary | None:
        """The fingerprint and token ids of key's blob, without its keys and values where a tier
        can (the header and ids, in the disk and Redis tiers), for an index over a large store
        (vLLM's connector). Trusted only if they reproduce the key (their content address);
        None on a miss. Not a use of the blob; no tier is filled."""
        if not self.owns(key):
            return None
        for tier in self._open_tiers():
            try:
                peek = getattr(tier, "peek", None)
                if peek is not None:
                    found = peek(key)
                else:
                    blob = tier.get(key)
                    found = None if blob is None else BlobSummary.of(blob)
            except BlobCorrupted as exc:
                log.debug("blob %s unreadable in the %s tier: %s", key[:12], tier.name, exc)
                continue
            if found is not None:
                if self.key(found.fingerprint, found.token_ids) == key:
                    return found
        return None

    def base_position(self, key: str) -> int | None:
        """Where key's blob had its first token when it was encoded (after the anchor alone, or
        after a context too), read as `peek` reads; None on a miss."""
        found = self.peek(key)
        return None if found is None else found.base_position

    def _find(self, tiers: tuple[Tier, ...], key: str) -> tuple[int, KVBlob] | None:
        """The first tier (by index) that holds a sound entry for key, with that entry."""
        for depth, tier in enumerate(tiers):
            try:
                blob = tier.get(key)
            except BlobCorrupted as exc:
                log.warning("discarding corrupted KV blob in the %s tier: %s", tier.name, exc)
                self._count("corrupt")
                tier.delete(key)
                continue
            if blob is not None:
                return depth, blob
        return None

    @staticmethod
    def _promote(tier: Tier, key: str, blob: KVBlob) -> None:
        try:
            tier.put(key, blob)
        except OSError as exc:
            # The read already has its blob; a tier that cannot take a copy (a full disk under
            # a remote hit) only costs a later lookup.
            log.warning("could not copy KV blob %s into the %s tier: %s", key, tier.name, exc)

    def prefetch(self, keys: Iterable[str], fingerprint: Fingerprint | None = None
                 ) -> list[Future]:
        """Start loading blobs in background threads; each is a `get`, so hits fill the faster
        tiers. Every namespace's store uses its root store's threads: a server's many cache
        salts do not each start a pool."""
        self._open_tiers()
        root = self._parent if self._parent is not None else self
        with root._lock:
            if root._closed:
                raise StoreClosedError(f"the KV store at {self.root} is closed")
            if root._pool is None:
                root._pool = ThreadPoolExecutor(root._prefetch_threads,
                                                thread_name_prefix="kv-prefetch")
            pool = root._pool
        return [pool.submit(self.get, key, fingerprint) for key in keys]

    # ---- management -------------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        """Remove key from every tier; True if any held it. A key of another namespace is
        not this store's to remove."""
        tiers = self._open_tiers()
        return self.owns(key) and any([tier.delete(key) for tier in tiers])  # ask them all

    def delete_doc(self, doc_id: str) -> list[str]:
        """Forget a document: delete the blobs only it used. Returns the deleted keys."""
        self._open_tiers()
        deleted = self.disk.delete_doc(doc_id)
        for key in deleted:
            self.delete(key)  # the copies in the other tiers
        return deleted

    def keys(self) -> list[str]:
        """Every key held by a write-through tier, sorted."""
        held = set()
        for tier in self._open_tiers():
            if tier.write_through:
                held.update(k for k in tier.keys() if self.owns(k))
        return sorted(held)

    def close(self) -> None:
        """Stop the prefetch threads (queued prefetches are cancelled, running ones finish) and
        close every tier. Closing twice is harmless."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pool, self._pool = self._pool, None
            children = [*self._children.values(), *self._salted.values()]
            self._children, self._salted = {}, LRUCache(self.MAX_SALTED)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for child in children:
            child.close()
        # a namespace's store closes its own disk tier (a salted one's is its tenant's); the
        # shared tiers are its parent's
        for tier in self.tiers if self._parent is None else (self.disk,) * self._owns_disk:
            tier.close()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def gc(self, keep: Fingerprint, *, temp_older_than_s: float = 3600.0) -> list[str]:
        """Delete every blob made by another model setup than `keep`, and temp files left by
        writers that died. Returns the deleted keys."""
        return maintenance.collect_garbage(self, keep, temp_older_than_s)

    def shrink(self, max_bytes: int | str) -> list[str]:
        """Evict the coldest blobs from the disk tier until it holds at most max_bytes (an int or
        a size such as "2GB"). Returns the keys removed; copies in the memory tiers stay."""
        self._open_tiers()
        return self.disk.shrink(parse_size(max_bytes))

    def verify(self, *, remove: bool = False) -> dict[str, str]:
        """Check every blob's checksum (of header and data) now, whatever was verified before.
        Returns {key: problem}; removes them if asked."""
        return maintenance.verify_blobs(self, remove)

    def stats(self) -> StoreStats:
        with self._lock:
            return self._stats.copy_with_tiers(self.memory, self.accelerator, self.disk)

    def disk_usage(self) -> dict:
        """Blobs and bytes on disk (all kinds), the prefix blobs' share, and the budgets."""
        usage = self.disk.usage()
        limit, prefix_limit = self.disk.budget()
        return {"blobs": sum(u["blobs"] for u in usage.values()),
                "bytes": sum(u["bytes"] for u in usage.values()),
                "prefix_blobs": usage["prefix"]["blobs"], "prefix_bytes": usage["prefix"]["bytes"],
                "budget_bytes": limit, "prefix_budget_bytes": prefix_limit}
