"""How a KVStore is configured: where it lives, and its tiers' budgets (`KVStore(config=)`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .. import environment

__all__ = ["StoreConfig", "default_store_path"]


def default_store_path() -> Path:
    """`TURBORAG_STORE`, else the package's cache folder's `kv` (core/environment.py)."""
    return environment.store_dir()


@dataclass(frozen=True)
class StoreConfig:
    """How a KVStore keeps its blobs (the fields are described on `KVStore`); checked here."""

    memory_bytes: int = 2 << 30
    storage_dtype: str = "native"
    accelerator_bytes: int = 0
    prefetch_threads: int = 4
    disk_bytes: int | str | None = None
    prefix_bytes: int | str | None = None
    remote_url: str | None = None

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "accelerator_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be ≥ 0 (0: no such tier), not {getattr(self, name)}")
        if self.prefetch_threads < 1:
            raise ValueError(f"prefetch_threads must be ≥ 1, not {self.prefetch_threads}")
