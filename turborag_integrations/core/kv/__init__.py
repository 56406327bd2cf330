"""KV data: what a prompt's keys and values are held in, and what they are stored as.

blob (KVBlob, Fingerprint, chunk_key: one chunk's keys and values and what made them) and cache
(KVCache, CachePool: the preallocated cache a prefill writes and decoding extends) → arena
(BatchArena: the caches of requests decoded together, as rows of one storage). Nothing here
runs a model: prefill (core/prefill/) and decode (core/decode/) fill these, the store
(core/store/) keeps blobs.
"""

from .arena import BatchArena
from .blob import Fingerprint, KVBlob, chunk_key
from .cache import CachePool, KVCache

__all__ = ["BatchArena", "CachePool", "Fingerprint", "KVBlob", "KVCache", "chunk_key"]
