"""KV store: blobs on disk within a byte budget, with bounded memory tiers in front.

    with KVStore("~/.cache/turborag/kv") as store:      # disk tier + 2 GiB memory tier
        key = store.put(blob, doc_id="a.md")            # content-addressed: same chunk, same key
        store.put(head, kind="prefix")                  # a prompt head: bounded apart
        blob = store.get(key, fingerprint)              # None on a miss; never another model's blob

The store is an ordered list of tiers, fastest first: the accelerator tier (when CUDA is present
and a budget is given), the memory tier, the disk tier, then a Redis tier shared by several
workers when a URL is given (`remote_url=` or $TURBORAG_REDIS_URL; `.redis_tier`), then any tiers
passed as `tiers=`. Every tier keeps the contract of `.tier.Tier`.
"""

from .budget import parse_size
from .codec import STORAGE_DTYPES
from .disk import KINDS, StoreWriteError
from .config import StoreConfig, default_store_path
from .kvstore import KVStore, StoreClosedError
from .stats import StoreStats
from .tier import Tier

__all__ = ["KVStore", "StoreConfig", "StoreStats", "StoreWriteError", "StoreClosedError", "Tier",
           "STORAGE_DTYPES", "KINDS", "default_store_path", "parse_size"]
