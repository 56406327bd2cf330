"""KV store: chunk blobs on disk, with a bounded memory tier in front.

    store = KVStore("~/.cache/turborag/kv")        # disk tier + 2 GiB memory tier
    key = store.put(blob)                           # content-addressed: same chunk, same key
    blob = store.get(key, fingerprint)              # None on a miss; never another model's blob
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..blob import Fingerprint, KVBlob
from ..errors import BlobCorrupted
from .disk import DiskTier, StoreWriteError
from .memory import MemoryTier

log = logging.getLogger(__name__)

__all__ = ["KVStore", "StoreStats", "StoreWriteError", "default_store_path"]


def default_store_path() -> Path:
    if os.environ.get("TURBORAG_STORE"):
        return Path(os.environ["TURBORAG_STORE"]).expanduser()
    from ..models import cache_dir

    return cache_dir() / "kv"


@dataclass
class StoreStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    corrupt: int = 0
    fingerprint_rejects: int = 0
    writes: int = 0
    bytes_written: int = 0
    memory_bytes: int = 0
    memory_evictions: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        total = self.memory_hits + self.disk_hits + self.misses
        return (self.memory_hits + self.disk_hits) / total if total else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_ratio"] = self.hit_ratio
        return d


class KVStore:
    def __init__(self, root: str | os.PathLike | None = None, *, memory_bytes: int = 2 << 30,
                 storage_dtype: str = "native"):
        self.disk = DiskTier(root or default_store_path(), storage_dtype)
        self.memory = MemoryTier(memory_bytes) if memory_bytes > 0 else None
        self._stats = StoreStats()
        self._lock = threading.Lock()

    @property
    def root(self) -> Path:
        return self.disk.root

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + n)

    def put(self, blob: KVBlob, *, doc_id: str | None = None) -> str:
        """Store a blob (a no-op write if it is already there) and record its document."""
        key = blob.key
        if not self.disk.contains(key):
            written = self.disk.put(key, blob)
            self._count("writes")
            self._count("bytes_written", written)
        if doc_id:
            self.disk.add_ref(key, doc_id)
        if self.memory is not None:
            self.memory.put(key, blob)
        return key

    def add_ref(self, key: str, doc_id: str) -> None:
        """Record that document `doc_id` uses the blob under `key`."""
        self.disk.add_ref(key, doc_id)

    def delete_doc(self, doc_id: str) -> list[str]:
        """Forget a document: delete the blobs only it used. Returns the deleted keys."""
        deleted = self.disk.delete_doc(doc_id)
        if self.memory is not None:
            for key in deleted:
                self.memory.delete(key)
        return deleted

    def contains(self, key: str) -> bool:
        return (self.memory is not None and key in self.memory) or self.disk.contains(key)

    def get(self, key: str, fingerprint: Fingerprint | None = None) -> KVBlob | None:
        """The blob under key, or None on a miss. A corrupted file is reported, removed and
        counted as a miss; a blob of another fingerprint is never returned."""
        blob = self.memory.get(key) if self.memory is not None else None
        if blob is not None:
            tier = "memory_hits"
        else:
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
            _, blob = found
            tier = "disk_hits"
        if fingerprint is not None and blob.fingerprint.id != fingerprint.id:
            log.warning("KV blob %s belongs to %s, not %s; ignoring it", key,
                        blob.fingerprint.describe(), fingerprint.describe())
            self._count("fingerprint_rejects")
            self._count("misses")
            return None
        self._count(tier)
        if tier == "disk_hits" and self.memory is not None:
            self.memory.put(key, blob)
        return blob

    def delete(self, key: str) -> bool:
        in_memory = self.memory.delete(key) if self.memory is not None else False
        return self.disk.delete(key) or in_memory

    def stats(self) -> StoreStats:
        with self._lock:
            s = StoreStats(**{k: v for k, v in asdict(self._stats).items()})
        if self.memory is not None:
            s.memory_bytes = self.memory.bytes
            s.memory_evictions = self.memory.evictions
        return s
