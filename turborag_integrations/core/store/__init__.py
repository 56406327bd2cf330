"""KV store: chunk blobs on disk, with bounded memory tiers in front.

    store = KVStore("~/.cache/turborag/kv")        # disk tier + 2 GiB memory tier
    key = store.put(blob, doc_id="a.md")            # content-addressed: same chunk, same key
    blob = store.get(key, fingerprint)              # None on a miss; never another model's blob

Reads go accelerator tier (when CUDA is present and a budget is given) → memory tier → disk.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable

import torch

from ..blob import Fingerprint, KVBlob
from ..errors import BlobCorrupted
from .codec import STORAGE_DTYPES
from .disk import DiskTier, StoreWriteError
from .memory import MemoryTier

log = logging.getLogger(__name__)

__all__ = ["KVStore", "StoreStats", "StoreWriteError", "STORAGE_DTYPES", "default_store_path"]


def default_store_path() -> Path:
    if os.environ.get("TURBORAG_STORE"):
        return Path(os.environ["TURBORAG_STORE"]).expanduser()
    from ..models import cache_dir

    return cache_dir() / "kv"


@dataclass
class StoreStats:
    accelerator_hits: int = 0
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    corrupt: int = 0
    fingerprint_rejects: int = 0
    writes: int = 0
    bytes_written: int = 0
    memory_bytes: int = 0
    memory_evictions: int = 0
    memory_rejections: int = 0
    accelerator_bytes: int = 0

    @property
    def hit_ratio(self) -> float:
        hits = self.accelerator_hits + self.memory_hits + self.disk_hits
        return hits / (hits + self.misses) if hits + self.misses else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_ratio"] = self.hit_ratio
        return d


class KVStore:
    """Durable, content-addressed storage of KV blobs.

    memory_bytes bounds the RAM tier (0 disables it); accelerator_bytes, when CUDA is available,
    adds a tier in GPU memory in front of it. storage_dtype is how blobs are written: "native"
    (the model's dtype, exact), "bfloat16"/"float16", or "int8" (KIVI-style, about a quarter of
    float32); any of them decodes to the model's dtype on load.
    """

    def __init__(self, root: str | os.PathLike | None = None, *, memory_bytes: int = 2 << 30,
                 storage_dtype: str = "native", accelerator_bytes: int = 0,
                 prefetch_threads: int = 4):
        self.disk = DiskTier(root or default_store_path(), storage_dtype)
        self.memory = MemoryTier(memory_bytes) if memory_bytes > 0 else None
        self.accelerator = (MemoryTier(accelerator_bytes, device="cuda")
                            if accelerator_bytes > 0 and torch.cuda.is_available() else None)
        self._stats = StoreStats()
        self._lock = threading.Lock()
        self._prefetch_threads = prefetch_threads
        self._pool: ThreadPoolExecutor | None = None

    @property
    def root(self) -> Path:
        return self.disk.root

    @property
    def storage_dtype(self) -> str:
        return self.disk.storage_dtype

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + n)

    def _tiers(self) -> list[tuple[str, MemoryTier]]:
        tiers = [("accelerator_hits", self.accelerator), ("memory_hits", self.memory)]
        return [(name, t) for name, t in tiers if t is not None]

    # ---- write ------------------------------------------------------------------------------
    def put(self, blob: KVBlob, *, doc_id: str | None = None) -> str:
        """Store a blob (no rewrite if it is already there) and record its document."""
        key = blob.key
        if not self.disk.contains(key):
            written = self.disk.put(key, blob)
            self._count("writes")
            self._count("bytes_written", written)
        if doc_id:
            self.disk.add_ref(key, doc_id)
        return key

    def add_ref(self, key: str, doc_id: str) -> None:
        """Record that document `doc_id` uses the blob under `key`."""
        self.disk.add_ref(key, doc_id)

    # ---- read -------------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return any(key in tier for _, tier in self._tiers()) or self.disk.contains(key)

    def get(self, key: str, fingerprint: Fingerprint | None = None) -> KVBlob | None:
        """The blob under key, or None on a miss. A corrupted file is reported, removed and
        counted as a miss; a blob of another fingerprint is never returned."""
        blob, tier_name = None, "disk_hits"
        for name, tier in self._tiers():
            blob = tier.get(key)
            if blob is not None:
                tier_name = name
                break
        if blob is None:
            try:
                found = self.disk.read(key)
            except BlobCorrupted as exc:
                log.warning("discarding corrupted KV blob: %s", exc)
                self._count("corrupt")
                self.disk.delete(key)
                found = None
            if found is None:
                self._count("misses")
                return None
            blob = found[1]
        if fingerprint is not None and blob.fingerprint.id != fingerprint.id:
            log.warning("KV blob %s belongs to %s, not %s; ignoring it", key,
                        blob.fingerprint.describe(), fingerprint.describe())
            self._count("fingerprint_rejects")
            self._count("misses")
            return None
        self._count(tier_name)
        if tier_name == "disk_hits" and self._tiers():
            # Disk blobs are views of a memory map: the page cache, not ours to keep. A memory
            # tier must own its bytes, or evicted pages would be re-read from disk on a "hit".
            blob = replace(blob, token_ids=blob.token_ids.clone(), keys=blob.keys.clone(),
                           values=blob.values.clone())
        for name, tier in self._tiers():
            if name == tier_name:
                break
            tier.put(key, blob)  # promote into the faster tiers it missed
        return blob

    def prefetch(self, keys: Iterable[str], fingerprint: Fingerprint | None = None
                 ) -> list[Future]:
        """Start loading blobs into the memory tiers in background threads."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._prefetch_threads, thread_name_prefix="kv-prefetch")
        return [self._pool.submit(self.get, key, fingerprint) for key in keys]

    # ---- management -------------------------------------------------------------------------
    def delete(self, key: str) -> bool:
        in_memory = any([tier.delete(key) for _, tier in self._tiers()])
        return self.disk.delete(key) or in_memory

    def delete_doc(self, doc_id: str) -> list[str]:
        """Forget a document: delete the blobs only it used. Returns the deleted keys."""
        deleted = self.disk.delete_doc(doc_id)
        for key in deleted:
            for _, tier in self._tiers():
                tier.delete(key)
        return deleted

    def keys(self) -> list[str]:
        return sorted(self.disk.keys())

    def gc(self, keep: Fingerprint, *, temp_older_than_s: float = 3600.0) -> list[str]:
        """Delete every blob made by another model setup than `keep`, and temp files left by
        writers that died. Returns the deleted keys."""
        self.disk.sweep_temp(temp_older_than_s)
        deleted = []
        for key in self.disk.keys():
            try:
                meta = self.disk.read_meta(key) or {}
                same = Fingerprint.from_json(meta["fingerprint"]).id == keep.id
            except (BlobCorrupted, KeyError, ValueError):
                same = False
            if not same:
                self.delete(key)
                deleted.append(key)
        return deleted

    def verify(self, *, remove: bool = False) -> dict[str, str]:
        """Check every blob's checksum now. Returns {key: problem}; removes them if asked."""
        problems = {}
        for key in self.disk.keys():
            try:
                self.disk.verify(key)
            except BlobCorrupted as exc:
                problems[key] = str(exc)
                if remove:
                    self.delete(key)
        return problems

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**asdict(self._stats))
        if self.memory is not None:
            s.memory_bytes = self.memory.bytes
            s.memory_evictions = self.memory.evictions
            s.memory_rejections = self.memory.rejections
        if self.accelerator is not None:
            s.accelerator_bytes = self.accelerator.bytes
        return s

    def disk_usage(self) -> dict:
        keys = list(self.disk.keys())
        return {"blobs": len(keys), "bytes": sum(self.disk.size_of(k) for k in keys)}
