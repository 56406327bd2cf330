"""KVStore.peek: what a blob is of (fingerprint, token ids) without reading its keys and values.

vLLM's connector indexes a whole store by its blobs' token ids; reading every blob whole would
read the whole store."""

from __future__ import annotations

import torch

from turborag_integrations.core.store import KVStore
from tests.core.store.test_tiers import FP, DictTier, make_blob


def disk_store(tmp_path, **options) -> KVStore:
    return KVStore(tmp_path / "kv", memory_bytes=0, remote_url="", **options)


def test_peek_gives_the_fingerprint_and_token_ids(tmp_path):
    store = disk_store(tmp_path)
    blob = make_blob(5, tokens=12)
    key = store.put(blob)
    found = store.peek(key)
    assert found.fingerprint == FP and found.token_ids == tuple(range(5, 17))
    assert store.peek(store.key(FP, [1, 2, 3])) is None  # never stored


def test_peek_reads_neither_keys_nor_values(tmp_path):
    store = disk_store(tmp_path)
    key = store.put(make_blob(0, tokens=64))
    path = store.disk.path(key)
    raw = bytearray(path.read_bytes())
    raw[-256:] = bytes(256)  # the end of the data section: keys and values, never the ids
    path.write_bytes(bytes(raw))
    assert store.peek(key).token_ids == tuple(range(64))  # the ids are intact, and all it read
    assert store.get(key) is None  # a read of the blob itself finds it corrupted


def test_ids_that_do_not_reproduce_their_key_are_not_trusted(tmp_path):
    store = disk_store(tmp_path)
    blob = make_blob(0, tokens=16)
    key = store.put(blob)
    path = store.disk.path(key)
    raw = bytearray(path.read_bytes())
    ids = torch.arange(0, 16).numpy().tobytes()
    at = bytes(raw).index(ids)
    raw[at] ^= 1  # token 0 becomes token 1
    path.write_bytes(bytes(raw))
    assert store.peek(key) is None


def test_peek_is_not_a_use_and_fills_no_tier(tmp_path):
    store = KVStore(tmp_path / "kv", memory_bytes=1 << 20, remote_url="")
    key = store.put(make_blob(0))
    store.memory.clear()
    assert store.peek(key).token_ids == tuple(range(8))
    assert not store.memory.contains(key)  # a get would have copied it into memory
    stats = store.stats()
    assert stats.disk_hits == stats.memory_hits == stats.misses == 0


def test_a_tier_without_peek_is_read_whole(tmp_path):
    remote = DictTier()
    store = KVStore(tmp_path / "kv", memory_bytes=0, remote_url="", tiers=[remote])
    blob = make_blob(3)
    remote.items[store.key(FP, blob.token_ids.tolist())] = blob
    [key] = list(remote.items)
    assert store.peek(key).token_ids == tuple(range(3, 11))


def test_a_namespace_peeks_only_its_own_keys(tmp_path):
    store = disk_store(tmp_path)
    key = store.namespace("acme").put(make_blob(0))
    assert store.namespace("acme").peek(key).token_ids == tuple(range(8))
    assert store.peek(key) is None and store.namespace("globex").peek(key) is None


def test_peek_gives_the_base_position(tmp_path):
    """Ingestion reads where a stored blob's first token sat (after the anchor alone, or after
    a context too) from its header, to replace blobs encoded alone."""
    store = disk_store(tmp_path)
    blob = make_blob(0, tokens=8)
    blob.base_position = 37
    key = store.put(blob)
    assert store.peek(key).base_position == 37
    assert KVStore(tmp_path / "m", remote_url="").memory.peek(key) is None
