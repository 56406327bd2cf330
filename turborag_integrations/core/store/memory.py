"""Memory tier: blobs kept in RAM (or accelerator memory), bounded in bytes.

Eviction is least-recently-used; admission is frequency-aware (TinyLFU, Einziger et al. 2017):
when the tier is full, a newcomer only displaces the LRU victim if it has been asked for at least
as often. A one-off scan over many cold chunks then cannot flush the hot ones.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import replace

import torch

from ..kv.blob import KVBlob
from .format import BlobSummary
from .tier import Tier


class MemoryTier(Tier):
    """A cache tier in RAM, or in accelerator memory when `device` is one (named "accelerator").

    It keeps the blobs it is given (moved to its device) and hands out the objects it holds.
    """

    def __init__(self, max_bytes: int = 2 << 30, *, device: str | torch.device = "cpu",
                 name: str | None = None):
        self.max_bytes = int(max_bytes)
        self.device = torch.device(device)
        self.name = name or ("memory" if self.device.type == "cpu" else "accelerator")
        self.bytes = 0
        self.evictions = 0
        self.rejections = 0
        self._items: OrderedDict[str, KVBlob] = OrderedDict()
        self._freq: dict[str, int] = {}
        self._touches = 0
        self._lock = threading.Lock()

    def _touch(self, key: str) -> None:
        self._freq[key] = self._freq.get(key, 0) + 1
        self._touches += 1
        # Age the counts so yesterday's hot chunk does not stay hot forever, and bound the table.
        if self._touches >= 10 * max(len(self._items), 64):
            self._freq = {k: v // 2 for k, v in self._freq.items() if v // 2 > 0}
            self._touches = 0

    def get(self, key: str) -> KVBlob | None:
        with self._lock:
            self._touch(key)
            blob = self._items.get(key)
            if blob is not None:
                self._items.move_to_end(key)
            return blob

    def put(self, key: str, blob: KVBlob) -> int:
        """Admit a blob if it fits and is not colder than what it would evict. Returns the bytes
        held for it, 0 if not admitted."""
        size = blob.nbytes
        if size > self.max_bytes:
            return 0
        with self._lock:
            held = self._items.get(key)
            if held is not None:
                self._items.move_to_end(key)
                return held.nbytes
            freq = self._freq.get(key, 0)
            victims, freed = [], 0
            for victim_key, victim in self._items.items():  # from least recently used
                if self.bytes - freed + size <= self.max_bytes:
                    break
                if self._freq.get(victim_key, 0) > freq:
                    self.rejections += 1
                    return 0
                victims.append(victim_key)
                freed += victim.nbytes
            for victim_key in victims:
                self.bytes -= self._items.pop(victim_key).nbytes
                self.evictions += 1
            if self.device.type != "cpu":
                blob = replace(blob, keys=blob.keys.to(self.device),
                               values=blob.values.to(self.device))
            self._items[key] = blob
            self.bytes += size
            return size

    def delete(self, key: str) -> bool:
        with self._lock:
            blob = self._items.pop(key, None)
            if blob is not None:
                self.bytes -= blob.nbytes
            return blob is not None

    def contains(self, key: str) -> bool:
        return key in self._items  # not a use: leaves the frequency counts alone

    def peek(self, key: str) -> BlobSummary | None:
        """What key's blob is of; not a use either."""
        blob = self._items.get(key)
        return None if blob is None else BlobSummary.of(blob)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.bytes = 0

    def close(self) -> None:
        self.clear()  # frees the memory now, not when the last reference to the store goes

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    __contains__ = contains
