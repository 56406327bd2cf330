"""KV store on real files: round trips, document references, corruption, fingerprints."""

import os

import pytest
import torch

from turborag_integrations.core.prefill.chunk_encoder import ChunkEncoder
from turborag_integrations.core.kv.blob import fingerprint_model
from turborag_integrations.core.store import KVStore
from tests.conftest import tiny_model
from tests.core.store.bounds import KEY_GROUP, assert_within_storage_bound
from tests.core.store.test_tiers import make_blob


@pytest.fixture(scope="module")
def blobs():
    loaded = tiny_model("llama")
    fp = fingerprint_model(loaded.model, loaded.tokenizer, loaded.name)
    enc = ChunkEncoder(loaded.model, loaded.tokenizer, fp)
    return fp, enc.encode_many(["first chunk of text", "second chunk", "third one"])


def test_round_trip_is_bit_exact(tmp_path, blobs):
    fp, (a, *_) = blobs
    store = KVStore(tmp_path, memory_bytes=0)
    key = store.put(a)
    got = store.get(key, fp)
    assert torch.equal(got.keys, a.keys) and torch.equal(got.values, a.values)
    assert torch.equal(got.token_ids, a.token_ids) and got.fingerprint == a.fingerprint
    assert store.stats().disk_hits == 1


def test_same_chunk_same_key_other_model_other_key(blobs):
    fp, (a, *_) = blobs
    other = tiny_model("llama", seed=3)
    fp2 = fingerprint_model(other.model, other.tokenizer, other.name)
    b = ChunkEncoder(other.model, other.tokenizer, fp2).encode("first chunk of text")
    assert a.key != b.key
    assert a.key == type(a)(a.token_ids, a.keys, a.values, fp).key


@pytest.mark.parametrize("where", [0, 30, -10], ids=["header-length", "header-json", "data"])
def test_corrupted_blob_is_a_miss_and_removed(tmp_path, blobs, where):
    fp, (a, *_) = blobs
    store = KVStore(tmp_path, memory_bytes=0)
    key = store.put(a)
    path = store.disk.path(key)
    data = bytearray(path.read_bytes())
    data[where] ^= 0xFF  # flip the bits of one byte
    path.write_bytes(bytes(data))
    assert store.get(key, fp) is None
    assert store.stats().corrupt == 1 and not path.exists()


@pytest.mark.parametrize("keep", [0, 5, 40, 0.5, -1],
                         ids=["empty", "in-length-field", "in-header", "half", "last-byte-lost"])
def test_truncated_blob_is_a_miss_and_removed(tmp_path, blobs, keep):
    fp, (a, *_) = blobs
    store = KVStore(tmp_path, memory_bytes=0)
    key = store.put(a)
    path = store.disk.path(key)
    size = os.path.getsize(path)
    path.write_bytes(path.read_bytes()[: int(size * keep) if isinstance(keep, float) else keep])
    assert store.get(key, fp) is None
    assert store.stats().corrupt == 1 and not path.exists()


def test_blob_of_another_fingerprint_is_never_returned(tmp_path, blobs):
    fp, (a, *_) = blobs
    other = tiny_model("llama", seed=5)
    fp2 = fingerprint_model(other.model, other.tokenizer, other.name)
    store = KVStore(tmp_path)
    key = store.put(a)
    assert store.get(key, fp2) is None
    assert store.stats().fingerprint_rejects == 1


def test_delete_doc_keeps_shared_blobs(tmp_path, blobs):
    fp, (a, b, c) = blobs
    store = KVStore(tmp_path)
    ka = store.put(a, doc_id="doc-1")
    kb = store.put(b, doc_id="doc-1")
    store.put(b, doc_id="doc-2")  # b is shared
    kc = store.put(c, doc_id="doc-2")
    assert store.delete_doc("doc-1") == [ka]
    assert not store.contains(ka) and store.contains(kb) and store.contains(kc)
    assert sorted(store.delete_doc("doc-2")) == sorted([kb, kc])
    assert not store.contains(kb) and not store.contains(kc)


def test_memory_tier_is_bounded_in_bytes(tmp_path, blobs):
    fp, (a, b, c) = blobs
    store = KVStore(tmp_path, memory_bytes=max(a.nbytes, b.nbytes, c.nbytes) * 2)
    keys = [store.put(blob) for blob in (a, b, c)]
    for key in keys:  # each read from disk is promoted into memory
        assert store.get(key, fp) is not None
    assert store.memory.bytes <= store.memory.max_bytes
    assert store.stats().memory_evictions >= 1
    assert store.get(keys[-1], fp) is not None and store.stats().memory_hits == 1


def test_hot_blobs_survive_a_one_off_scan(tmp_path, blobs):
    fp, (hot, *_) = blobs
    from turborag_integrations.core.kv.blob import KVBlob
    store = KVStore(tmp_path, memory_bytes=hot.nbytes * 3)
    hot_key = store.put(hot)
    for _ in range(3):
        store.get(hot_key, fp)
    cold = []
    for i in range(10):  # a scan: ten different chunks, each read once
        blob = KVBlob(hot.token_ids + 1 + i, hot.keys, hot.values, fp)
        cold.append(store.put(blob))
        store.get(cold[-1], fp)
    assert hot_key in store.memory
    assert store.stats().memory_rejections > 0


def test_gc_removes_other_fingerprints_and_verify_finds_corruption(tmp_path, blobs):
    fp, (a, b, _) = blobs
    other = tiny_model("llama", seed=9)
    fp2 = fingerprint_model(other.model, other.tokenizer, other.name)
    alien = ChunkEncoder(other.model, other.tokenizer, fp2).encode("first chunk of text")
    store = KVStore(tmp_path)
    ka, kb, kx = store.put(a), store.put(b), store.put(alien)
    assert store.gc(keep=fp) == [kx]
    assert store.keys() == sorted([ka, kb])
    path = store.disk.path(kb)
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    problems = store.verify(remove=True)
    assert list(problems) == [kb] and "checksum" in problems[kb]
    assert store.keys() == [ka]


def test_prefetch_loads_into_memory(tmp_path, blobs):
    fp, (a, b, c) = blobs
    store = KVStore(tmp_path)
    keys = [store.put(x) for x in (a, b, c)]
    for future in store.prefetch(keys, fp):
        assert future.result() is not None
    assert all(k in store.memory for k in keys)


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float16", "int8"])
def test_storage_dtypes_decode_to_model_dtype(tmp_path, blobs, storage_dtype):
    fp, (a, *_) = blobs
    store = KVStore(tmp_path, memory_bytes=0, storage_dtype=storage_dtype)
    got = store.get(store.put(a), fp)
    assert got.keys.dtype == a.keys.dtype
    # within the codec's own error bound, element by element (tests/core/store/bounds.py)
    assert_within_storage_bound(got.keys, a.keys, storage_dtype, "keys")
    assert_within_storage_bound(got.values, a.values, storage_dtype, "values")
    assert not torch.equal(got.keys, a.keys)  # it was stored in reduced precision
    native = KVStore(tmp_path / "n", memory_bytes=0)
    native.put(a)
    assert store.disk_usage()["bytes"] < native.disk_usage()["bytes"]


def test_int8_key_groups_span_many_tokens(tmp_path):
    """Keys of more than one 64-token group (the last one partial) stay within the bound of
    their own group; the bound's grouping is the codec's."""
    from turborag_integrations.core.kv.blob import Fingerprint, KVBlob
    from turborag_integrations.core.store import codec

    assert KEY_GROUP == codec.KEY_GROUP
    fp = Fingerprint(model="m", config="c", weights="w", tokenizer="t", dtype="float32")
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 150, 16, generator=g)
    keys[:, :, 64:128] *= 20  # a group of large keys must not loosen the others' bound
    values = torch.randn(2, 2, 150, 16, generator=g) * torch.linspace(0.01, 10, 150)[:, None]
    blob = KVBlob(torch.arange(150), keys, values, fp)
    store = KVStore(tmp_path, memory_bytes=0, storage_dtype="int8")
    got = store.get(store.put(blob), fp)
    assert_within_storage_bound(got.keys, keys, "int8", "keys")
    assert_within_storage_bound(got.values, values, "int8", "values")


def test_replace_overwrites_every_tier_and_keeps_the_documents(tmp_path):
    """put(replace=True): the new blob under the same key in the disk tier, the memory tier's
    copy of the old one gone, the documents that use the key still recorded."""
    store = KVStore(tmp_path / "kv", remote_url="")
    old = make_blob(0, tokens=8)
    key = store.put(old, doc_id="a")
    assert torch.equal(store.get(key).keys, old.keys) and store.memory.contains(key)
    new = make_blob(0, tokens=8)
    new.base_position = 5
    assert store.put(new, doc_id="b") == key  # same tokens, same fingerprint: same key
    assert torch.equal(store.get(key).keys, old.keys)  # without replace the first one stays
    store.put(new, replace=True)
    got = store.get(key)
    assert torch.equal(got.keys, new.keys) and got.base_position == 5
    assert KVStore(tmp_path / "kv", remote_url="").get(key).base_position == 5  # on disk too
    assert store.delete_doc("a") == [] and store.delete_doc("b") == [key]  # refs kept
    store.close()
