"""The contract every storage tier of a KVStore keeps.

A tier maps content-addressed keys to KV blobs. KVStore keeps an ordered list of them, fastest
first, and treats them all alike: a lookup asks each in turn, a hit is copied into the faster
tiers that missed it, a delete goes to every tier. A new kind of storage (a remote cache shared
by several machines, say) is one class that keeps this contract, passed as
`KVStore(..., tiers=[...])`; KVStore itself does not change.

What each method promises:

- `contains(key) -> bool`: whether `get(key)` would find an entry now. It must not count as a
  use of the entry (a memory tier's admission policy counts uses).
- `get(key) -> KVBlob | None`: the blob, or None when the tier does not hold it. An entry the tier
  cannot trust (bad checksum, truncated, unparseable) raises `BlobCorrupted`; the store then
  deletes it from that tier, counts it and looks further. The caller may keep the returned blob
  as long as it likes but must not modify its tensors in place: a memory tier hands out the very
  object it holds. When `lends_views` is true the tensors are views of memory the tier does not
  own (a memory map of a file): reading them may go back to the disk, so whoever caches the blob
  copies it first (`owned_copy`).
- `put(key, blob) -> int`: offer a blob; returns the bytes the tier now holds for the key (the
  existing entry's size when it already had one), or 0 when it declined (too big, or colder than
  what it would evict). The tier either copies the blob or keeps a reference to it, so the caller
  must not modify it afterwards. Errors of durable storage (a full disk) are raised, not hidden.
  A tier bounds what it holds by its own policy; KVStore also tells its disk tier each blob's
  kind (`put(key, blob, kind)`, "chunk" or "prefix") so that prompt heads are bounded apart, and
  reports hits served by faster tiers to it (`note_read`); other tiers get `put(key, blob)`.
- `delete(key) -> bool`: remove the entry; True when there was one.
- `keys() -> list[str]`: the keys held now, in no particular order.
- `peek(key) -> BlobSummary | None`, optional: what the blob is of (fingerprint, token ids),
  read without its keys and values and unverified, and not a use of the entry; None when absent;
  BlobCorrupted when even that cannot be read. KVStore reads a tier without it whole.
- `close() -> None`: release what the tier holds (memory, connections, files). Calling it twice
  is harmless; no other method is called after it.

Attributes:

- `name`: what the store's statistics call the tier ("accelerator", "memory", "disk"; hits of
  any other name are counted in `StoreStats.other_hits`).
- `write_through`: True when `KVStore.put` writes every new blob to this tier (durable and shared
  tiers); False for caches that are only filled by reads.
- `lends_views`: see `get`.

Every method may be called from several threads at once: prefetching runs `get` in a pool.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, runtime_checkable

from ..kv.blob import KVBlob

__all__ = ["Tier", "owned_copy"]


@runtime_checkable
class Tier(Protocol):
    """One level of KV storage; see the module docstring for what each method promises.

    Subclassing is optional (any object with these members will do); it brings the defaults of
    `write_through`, `lends_views` and `close`.
    """

    name: str
    write_through: bool = False
    lends_views: bool = False

    def contains(self, key: str) -> bool: ...

    def get(self, key: str) -> KVBlob | None: ...

    def put(self, key: str, blob: KVBlob) -> int: ...

    def delete(self, key: str) -> bool: ...

    def keys(self) -> list[str]: ...

    def close(self) -> None:
        return None


def owned_copy(blob: KVBlob) -> KVBlob:
    """The blob with tensors of its own, for a tier that lends views of memory it does not own."""
    return replace(blob, token_ids=blob.token_ids.clone(), keys=blob.keys.clone(),
                   values=blob.values.clone())
