"""The tier contract: every tier keeps it, a tier of one's own plugs into KVStore unchanged, and
closing a store stops its prefetch threads."""

import pytest
import torch

from turborag_integrations.core.kv.blob import Fingerprint, KVBlob
from turborag_integrations.core.store import KVStore, StoreClosedError
from turborag_integrations.core.store.disk import DiskTier
from turborag_integrations.core.store.memory import MemoryTier
from turborag_integrations.core.store.tier import Tier

FP = Fingerprint(model="test", config="c", weights="w", tokenizer="t", dtype="float32")


def make_blob(first_token: int = 0, tokens: int = 8) -> KVBlob:
    keys = torch.randn(2, 2, tokens, 16)
    return KVBlob(torch.arange(first_token, first_token + tokens), keys, keys * 2, FP)


class DictTier:
    """A tier of one's own, duck-typed (no subclassing), the way a remote cache would be."""

    name = "remote"
    write_through = True
    lends_views = False

    def __init__(self):
        self.items: dict[str, KVBlob] = {}
        self.closed = 0

    def contains(self, key):
        return key in self.items

    def get(self, key):
        return self.items.get(key)

    def put(self, key, blob):
        self.items[key] = blob
        return blob.nbytes

    def delete(self, key):
        return self.items.pop(key, None) is not None

    def keys(self):
        return list(self.items)

    def close(self):
        self.closed += 1


TIERS = {
    "memory": lambda tmp_path: MemoryTier(1 << 20),
    "disk": lambda tmp_path: DiskTier(tmp_path),
    "accelerator": lambda tmp_path: MemoryTier(1 << 20, device="cuda"),
}


@pytest.fixture(params=list(TIERS))
def tier(request, tmp_path):
    if request.param == "accelerator" and not torch.cuda.is_available():
        pytest.skip("the accelerator tier needs CUDA")
    tier = TIERS[request.param](tmp_path)
    yield tier
    tier.close()


def test_every_tier_keeps_the_contract(tier):
    assert isinstance(tier, Tier) and tier.name in TIERS
    assert isinstance(tier.write_through, bool) and isinstance(tier.lends_views, bool)
    blob = make_blob()
    key = blob.key
    assert tier.contains(key) is False and tier.get(key) is None
    assert tier.delete(key) is False and tier.keys() == []

    held = tier.put(key, blob)
    assert type(held) is int and held > 0
    assert tier.contains(key) is True
    got = tier.get(key)
    assert isinstance(got, KVBlob) and got.fingerprint == FP
    assert torch.equal(got.keys.cpu(), blob.keys) and torch.equal(got.values.cpu(), blob.values)
    assert torch.equal(got.token_ids.cpu(), blob.token_ids)
    assert tier.keys() == [key] and isinstance(tier.keys(), list)
    assert tier.put(key, blob) > 0  # already held: still reports its bytes

    assert tier.delete(key) is True
    assert tier.contains(key) is False and tier.get(key) is None and tier.keys() == []
    tier.close()
    tier.close()  # twice is harmless


def test_memory_tier_reports_a_declined_blob_as_zero_bytes():
    blob = make_blob()
    tier = MemoryTier(blob.nbytes - 1)
    assert tier.put(blob.key, blob) == 0 and not tier.contains(blob.key)


def test_a_tier_of_ones_own_gets_writes_hits_and_deletes(tmp_path):
    remote = DictTier()
    store = KVStore(tmp_path, tiers=[remote])
    assert store.tiers == (store.memory, store.disk, remote)
    blob = make_blob()
    key = store.put(blob)
    assert key in remote.items and store.disk.contains(key)  # written through to both
    assert store.stats().writes == 2

    store.disk.delete(key)  # only the remote tier has it now
    got = store.get(key, FP)
    assert got is not None and torch.equal(got.keys, blob.keys)
    assert store.stats().other_hits == {"remote": 1}
    assert store.disk.contains(key) and store.memory.contains(key)  # promoted on the way back
    assert store.get(key, FP) is not None and store.stats().memory_hits == 1
    assert store.stats().hit_ratio == 1.0

    only_remote = make_blob(100)
    remote.put(only_remote.key, only_remote)
    assert store.keys() == sorted([key, only_remote.key])

    assert store.delete(key) and not store.contains(key) and key not in remote.items
    store.close()
    assert remote.closed == 1


def test_a_corrupted_entry_falls_through_to_the_next_tier(tmp_path):
    remote = DictTier()
    store = KVStore(tmp_path, memory_bytes=0, tiers=[remote])
    key = store.put(make_blob())
    path = store.disk.path(key)
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    assert store.get(key, FP) is not None
    stats = store.stats()
    assert stats.corrupt == 1 and stats.other_hits == {"remote": 1} and stats.misses == 0
    assert store.disk.get(key) is not None  # rewritten from the remote copy


def test_a_view_lending_tier_is_copied_before_a_cache_keeps_it(tmp_path):
    lender = DictTier()
    lender.lends_views = True
    store = KVStore(tmp_path, tiers=[lender])
    blob = make_blob()
    lender.put(blob.key, blob)
    store.get(blob.key, FP)
    kept = store.memory.get(blob.key)
    assert kept is not blob and kept.keys.data_ptr() != blob.keys.data_ptr()
    assert torch.equal(kept.keys, blob.keys)


def test_an_object_that_is_not_a_tier_is_refused(tmp_path):
    with pytest.raises(TypeError, match="tier contract"):
        KVStore(tmp_path, tiers=[object()])


def test_close_stops_the_prefetch_pool_and_closes_the_tiers(tmp_path):
    remote = DictTier()
    with KVStore(tmp_path, tiers=[remote]) as store:
        key = store.put(make_blob())
        assert [f.result() is not None for f in store.prefetch([key], FP)] == [True]
        pool = store._pool
        assert store.memory.contains(key)
    assert store._pool is None
    with pytest.raises(RuntimeError):
        pool.submit(print)  # shut down
    assert remote.closed == 1 and len(store.memory) == 0
    store.close()  # twice is harmless
    assert remote.closed == 1
    with pytest.raises(StoreClosedError, match="closed"):
        store.prefetch([key], FP)
    with pytest.raises(StoreClosedError):
        store.get(key, FP)
