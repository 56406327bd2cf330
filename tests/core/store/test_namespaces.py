"""Invariant 10 in the store: a blob of one namespace (tenant) is not addressable from another on
any tier, and nothing one namespace does to its blobs (gc, eviction, shrink, document deletion)
removes another's."""

from __future__ import annotations

import shutil

import pytest

from turborag_integrations.core.kv.blob import chunk_key
from turborag_integrations.core.store import KVStore
from tests.core.store.test_redis_tier import RedisServer
from tests.core.store.test_tiers import FP, make_blob

TEXTS = 12  # blobs of "tenant A"


def blobs():
    return [make_blob(first_token=100 * i, tokens=8 + i) for i in range(TEXTS)]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with RedisServer(tmp_path_factory.mktemp("redis")) as running:
        yield running.url


def test_the_default_namespace_keeps_its_keys(tmp_path):
    blob = make_blob()
    with KVStore(tmp_path) as store:
        assert store.put(blob) == blob.key == chunk_key(FP, blob.token_ids.tolist())
        assert store.namespace("") is store and store.namespace_name == ""


@pytest.mark.parametrize("with_redis", [False, True])
def test_tenant_b_derives_no_key_of_tenant_a_on_any_tier(tmp_path, request, with_redis):
    url = request.getfixturevalue("redis_url") if with_redis else ""
    with KVStore(tmp_path, remote_url=url) as root:
        a, b = root.namespace("tenant-a"), root.namespace("tenant-b")
        made = blobs()
        a_keys = [a.put(blob) for blob in made]
        for key in a_keys:
            assert a.get(key, FP) is not None  # now in the shared memory tier too
        b_keys = [b.key(blob.fingerprint, blob.token_ids.tolist()) for blob in made]
        assert not set(a_keys) & set(b_keys)
        tiers = {t.name for t in b.tiers}
        assert tiers == ({"memory", "disk", "redis"} if with_redis else {"memory", "disk"})
        for tier in b.tiers:  # B's keys of A's exact texts: a miss in every tier
            assert not any(tier.contains(k) for k in b_keys), tier.name
        assert not any(b.contains(k) or b.get(k, FP) is not None for k in b_keys)
        # and A's own keys, were B to learn them, are not B's to read, list or delete
        assert not any(b.contains(k) or b.get(k, FP) is not None for k in a_keys)
        assert b.keys() == [] and not any(b.delete(k) for k in a_keys)
        assert root.keys() == [] and not any(root.contains(k) for k in a_keys)
        assert sorted(a.keys()) == sorted(a_keys)
        assert all(a.get(k, FP) is not None for k in a_keys)


def test_one_tenants_gc_shrink_eviction_and_documents_never_remove_anothers(tmp_path):
    with KVStore(tmp_path, disk_bytes="64KiB", memory_bytes=0) as root:
        a, b = root.namespace("tenant-a"), root.namespace("tenant-b")
        a_keys = [a.put(blob, doc_id="shared-name.md") for blob in blobs()[:4]]
        other_fp = FP.with_encoding("anchor:0:ffffffff")
        # B: a gc that keeps nothing of A's model, a document of the same name, a shrink to
        # nothing, and a flood of blobs far over its budget (eviction)
        b.put(make_blob(first_token=9900), doc_id="shared-name.md")
        b.gc(other_fp)
        b.delete_doc("shared-name.md")
        for i in range(40):
            b.put(make_blob(first_token=20000 + 100 * i, tokens=64))
        assert b.disk.evictions > 0
        b.shrink(0)
        assert b.keys() == []
        assert sorted(a.keys()) == sorted(a_keys)
        assert all(a.get(k, FP) is not None for k in a_keys)
        assert a.verify() == {} and a.disk.evictions == 0


def test_a_salted_namespace_shares_its_tenants_disk_but_not_its_keys(tmp_path):
    with KVStore(tmp_path) as root:
        tenant, salted = root.namespace("acme"), root.namespace("acme/s1")
        assert salted.disk is tenant.disk and salted.root == tenant.root != root.root
        blob = make_blob()
        k1, k2 = tenant.put(blob), salted.put(blob)
        assert k1 != k2 and tenant.keys() == [k1] and salted.keys() == [k2]
        salted.gc(FP.with_encoding("anchor:0:ffffffff"))  # removes its own blob only
        assert salted.keys() == [] and tenant.keys() == [k1]
        # a salt without a tenant lives in the default namespace's folder, with its own keys
        plain_salted = root.namespace("/s1")
        assert plain_salted.disk is root.disk
        assert plain_salted.put(blob) not in (k1, k2, blob.key) and root.keys() == []


def test_namespaces_close_with_their_store_and_are_validated(tmp_path):
    root = KVStore(tmp_path)
    child = root.namespace("a")
    assert root.namespace("a") is child and child.namespace("b") is root.namespace("b")
    assert child.namespace("") is root
    with pytest.raises(ValueError, match="NUL"):
        root.namespace("a\x00b")
    with pytest.raises(TypeError):
        root.namespace(None)  # type: ignore[arg-type]
    root.close()
    with pytest.raises(Exception, match="closed"):
        child.get("x")


def test_salts_gone_quiet_are_let_go_and_tenants_are_kept(tmp_path, monkeypatch):
    """A server may see a cache salt per user: the store keeps the most recent salted
    namespaces' objects only, and their blobs stay in the tenant's disk tier."""
    monkeypatch.setattr(KVStore, "MAX_SALTED", 3)
    with KVStore(tmp_path) as root:
        tenant = root.namespace("acme")
        first = root.namespace("acme/s0")
        key = first.put(make_blob())
        for i in range(1, 6):
            root.namespace(f"acme/s{i}")
            root.namespace("acme/s5")  # asked for again: the most recent
        assert len(root._salted) == 3 and root.namespace("acme") is tenant
        assert root.namespace("acme/s5") is root.namespace("acme/s5")
        again = root.namespace("acme/s0")  # let go: made again, the same blobs
        assert again is not first and again.get(key, FP) is not None
        assert first.get(key, FP) is not None  # one still held keeps working


def test_every_namespace_prefetches_on_its_root_stores_threads(tmp_path):
    import threading

    def prefetch_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("kv-prefetch")}

    before = prefetch_threads()  # other tests' stores may still hold theirs
    with KVStore(tmp_path, prefetch_threads=2) as root:
        keys = {}
        for i in range(20):
            store = root.namespace(f"acme/s{i}")
            keys[store] = store.put(make_blob(first_token=i))
        for store, key in keys.items():
            [future] = store.prefetch([key], FP)
            assert future.result() is not None
        assert len(prefetch_threads() - before) <= 2  # not two per salt
    with pytest.raises(Exception, match="closed"):
        store.prefetch([key], FP)
