"""A store's upkeep over the blobs it owns on disk: removing what another model setup made,
and checking every checksum now (`KVStore.gc`, `KVStore.verify`)."""

from __future__ import annotations

from ..errors import BlobCorrupted
from ..kv.blob import Fingerprint


def collect_garbage(store, keep: Fingerprint, temp_older_than_s: float) -> list[str]:
    """Delete every blob of `store` made by another model setup than `keep`, and temp files
    left by writers that died. Returns the deleted keys."""
    store.disk.sweep_temp(temp_older_than_s)
    deleted = []
    for key in filter(store.owns, store.disk.keys()):
        try:
            meta = store.disk.read_meta(key) or {}
            same = Fingerprint.from_json(meta["fingerprint"]).id == keep.id
        except (BlobCorrupted, KeyError, TypeError, ValueError):
            same = False
        if not same:
            store.delete(key)
            deleted.append(key)
    return deleted


def verify_blobs(store, remove: bool) -> dict[str, str]:
    """{key: problem} for every blob of `store` whose checksum fails; removed if asked."""
    problems = {}
    for key in filter(store.owns, store.disk.keys()):
        try:
            store.disk.verify(key)
        except BlobCorrupted as exc:
            problems[key] = str(exc)
            if remove:
                store.delete(key)
    return problems
