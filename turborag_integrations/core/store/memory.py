"""Memory tier: blobs kept in RAM, least recently used evicted first, bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..blob import KVBlob


class MemoryTier:
    def __init__(self, max_bytes: int = 2 << 30):
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.evictions = 0
        self._items: OrderedDict[str, KVBlob] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> KVBlob | None:
        with self._lock:
            blob = self._items.get(key)
            if blob is not None:
                self._items.move_to_end(key)
            return blob

    def put(self, key: str, blob: KVBlob) -> bool:
        """Admit a blob, evicting the least recently used; False when it can never fit."""
        size = blob.nbytes
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes
            while self.bytes + size > self.max_bytes and self._items:
                _, victim = self._items.popitem(last=False)
                self.bytes -= victim.nbytes
                self.evictions += 1
            self._items[key] = blob
            self.bytes += size
            return True

    def delete(self, key: str) -> bool:
        with self._lock:
            blob = self._items.pop(key, None)
            if blob is not None:
                self.bytes -= blob.nbytes
            return blob is not None

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: str) -> bool:
        return key in self._items
