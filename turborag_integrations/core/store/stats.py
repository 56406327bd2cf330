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

    @property
    def hit_ratio(self) -> float:
        hits = (self.accelerator_hits + self.memory_hits + self.disk_hits
                + sum(self.other_hits.values()))
        return hits / (hits + self.misses) if hits + self.misses else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["hit_ratio"] = self.hit_ratio
        return d
