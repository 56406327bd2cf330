"""KV store on real files: round trips, document references, corruption, fingerprints."""

import os

import pytest
import torch

from turborag_integrations.core.blob import ChunkEncoder, fingerprint_model
from turborag_integrations.core.store import KVStore
from tests.conftest import tiny_model


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


def test_corrupted_blob_is_a_miss_and_removed(tmp_path, blobs):
    fp, (a, *_) = blobs
    store = KVStore(tmp_path, memory_bytes=0)
    key = store.put(a)
    path = store.disk.path(key)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside the tensor data
    path.write_bytes(bytes(data))
    assert store.get(key, fp) is None
    assert store.stats().corrupt == 1 and not path.exists()


def test_truncated_blob_is_a_miss(tmp_path, blobs):
    fp, (a, *_) = blobs
    store = KVStore(tmp_path, memory_bytes=0)
    key = store.put(a)
    path = store.disk.path(key)
    path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    assert store.get(key, fp) is None and store.stats().corrupt == 1


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
    store = KVStore(tmp_path, memory_bytes=a.nbytes + b.nbytes)
    for blob in (a, b, c):
        store.put(blob)
    assert store.memory.bytes <= a.nbytes + b.nbytes
    assert store.stats().memory_evictions >= 1
