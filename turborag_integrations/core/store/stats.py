"""What a KVStore counts: hits per tier, misses, rejects, writes and evictions (`KVStore.stats()`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Tiers whose hits have a field of their own in StoreStats; others count in `other_hits`.
NAMED_TIERS = ("accelerator", "memory", "disk")


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
    disk_evictions: int = 0
    memory_bytes: int = 0
    memory_evictions: int = 0
    memory_rejections: int = 0
    accelerator_bytes: int = 0
    other_hits: dict[str, int] = field(default_factory=dict)  # by tier name, for `tiers=`

    def count(self, name: str, n: int = 1) -> None:
        setattr(self, name, getattr(self, name) + n)

    def count_hit(self, tier: str) -> None:
        if tier in NAMED_TIERS:
            self.count(f"{tier}_hits")
        else:
            self.other_hits[tier] = self.other_hits.get(tier, 0) + 1

    def copy_with_tiers(self, memory, accelerator, disk) -> "StoreStats":
        """A copy with what the tiers hold now (bytes, evictions) filled in."""
        s = StoreStats(**asdict(self))  # asdict copies other_hits too
        if memory is not None:
            s.memory_bytes, s.memory_evictions = memory.bytes, memory.evictions
            s.memory_rejections = memory.rejections
        if accelerator is not None:
            s.accelerator_bytes = accelerator.bytes
        s.disk_evictions = disk.evictions
        return s

    @property
    def hit_ratio(self) -> float:
        hits = (self.accelerator_hits + self.memory_hits + self.disk_hits
                + sum(self.other_hits.values()))
        return hits / (hits + self.misses) if hits + self.misses else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_ratio"] = self.hit_ratio
        return d
