"""The blob file's header: sealed by the checksum with the data, read back safely when it is not
(files of the earlier format), and verified once per file version per process."""

import json
import os
import struct

import pytest
import torch
import xxhash
from safetensors.torch import save as st_save

from turborag_integrations.core.errors import BlobCorrupted
from turborag_integrations.core.kv.blob import Fingerprint, KVBlob
from turborag_integrations.core.store import KVStore, codec, format
from tests.core.store.bounds import assert_within_storage_bound

FP = Fingerprint(model="test", config="c", weights="w", tokenizer="t", dtype="float32")


def make_blob(tokens: int = 8, base_position: int = 0) -> KVBlob:
    keys = torch.randn(2, 2, tokens, 16)
    return KVBlob(torch.arange(tokens), keys, keys * 2, FP, base_position=base_position)


def replace_once(path, old: bytes, new: bytes) -> None:
    """Edit the file in place: same length, so the JSON header stays valid and in place."""
    raw = path.read_bytes()
    assert len(old) == len(new) and raw.count(old) >= 1, (old, raw[:600])
    path.write_bytes(raw.replace(old, new, 1))


def rewrite_header(path, edit, *, reseal: bool) -> None:
    """Parse the header, edit it, write the file again: sealed anew (as a writer would) or not."""
    header, data = format.header_and_data(path.read_bytes())
    edit(header)
    if reseal:
        path.write_bytes(format.assemble(header, data))
        return
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data))


def write_format_1(path, blob: KVBlob, storage_dtype: str) -> None:
    """A file as earlier versions wrote it: the checksum covers the data section only."""
    tensors, meta = codec.to_stored(blob, storage_dtype)
    meta = {"magic": format.MAGIC, "format": "1", "fingerprint": blob.fingerprint.to_json(),
            **meta, "key": blob.key}
    _, data = format.header_and_data(st_save(tensors, metadata=meta))
    meta["checksum"] = xxhash.xxh3_128_hexdigest(data)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(st_save(tensors, metadata=meta))


def assert_reported_miss(store: KVStore, key: str, path) -> None:
    assert store.get(key, FP) is None
    assert store.stats().corrupt == 1 and not path.exists()


@pytest.mark.parametrize("storage_dtype, old, new", [
    ("int8", b'"storage_dtype":"int8"', b'"storage_dtype":"bf16"'),
    ("float16", b'"storage_dtype":"float16"', b'"storage_dtype":"float32"'),
    ("int8", b'"dtype":"U8"', b'"dtype":"I8"'),  # int8 codes read as signed bytes
    ("native", b'"base_position":"0"', b'"base_position":"7"'),  # RoPE at the wrong place
    ("native", b'"base_position":"0"', b'"base_position":  0'),  # not a string any more
])
def test_a_changed_header_is_a_miss_not_garbage(tmp_path, storage_dtype, old, new):
    store = KVStore(tmp_path, memory_bytes=0, storage_dtype=storage_dtype)
    key = store.put(make_blob())
    path = store.disk.path(key)
    replace_once(path, old, new)
    assert_reported_miss(store, key, path)


@pytest.mark.parametrize("reseal", [False, True], ids=["edited", "newer-writer"])
def test_an_unknown_fingerprint_field_is_a_miss_without_an_exception(tmp_path, reseal):
    store = KVStore(tmp_path, memory_bytes=0)
    key = store.put(make_blob())
    path = store.disk.path(key)

    def add_field(header):
        fp = json.loads(header["__metadata__"]["fingerprint"])
        header["__metadata__"]["fingerprint"] = json.dumps({**fp, "quantizer": "q4"})

    rewrite_header(path, add_field, reseal=reseal)
    assert_reported_miss(store, key, path)


def test_a_file_of_an_unknown_format_is_a_miss(tmp_path):
    store = KVStore(tmp_path, memory_bytes=0)
    key = store.put(make_blob())
    path = store.disk.path(key)
    replace_once(path, b'"format":"2"', b'"format":"3"')
    with pytest.raises(BlobCorrupted, match="format '3'"):
        store.disk.get(key)
    assert_reported_miss(store, key, path)


@pytest.mark.parametrize("storage_dtype", ["native", "int8"])
def test_files_of_the_earlier_format_still_read(tmp_path, storage_dtype):
    store = KVStore(tmp_path, memory_bytes=0, storage_dtype=storage_dtype)
    blob = make_blob(base_position=3)
    write_format_1(store.disk.path(blob.key), blob, storage_dtype)
    got = store.get(blob.key, FP)
    assert got is not None and got.base_position == 3
    if storage_dtype == "native":
        assert torch.equal(got.keys, blob.keys) and torch.equal(got.values, blob.values)
    else:
        assert_within_storage_bound(got.keys, blob.keys, storage_dtype, "keys")
        assert_within_storage_bound(got.values, blob.values, storage_dtype, "values")
    assert store.verify() == {}


@pytest.mark.parametrize("old, new", [
    (b'"dtype":"U8"', b'"dtype":"I8"'),  # the data checksum of format 1 cannot see this...
    (b'"storage_dtype":"int8"', b'"storage_dtype":"none"'),
])
def test_an_inconsistent_header_of_the_earlier_format_is_a_miss(tmp_path, old, new):
    store = KVStore(tmp_path, memory_bytes=0, storage_dtype="int8")
    blob = make_blob()
    path = store.disk.path(blob.key)
    write_format_1(path, blob, "int8")
    replace_once(path, old, new)
    assert_reported_miss(store, blob.key, path)  # ...the consistency check does


def test_an_unknown_fingerprint_field_in_the_earlier_format_is_a_miss(tmp_path):
    store = KVStore(tmp_path, memory_bytes=0)
    blob = make_blob()
    path = store.disk.path(blob.key)
    write_format_1(path, blob, "native")
    replace_once(path, b'\\"format\\": 1', b'\\"formax\\": 1')
    assert_reported_miss(store, blob.key, path)


def test_a_blob_is_verified_once_per_file_version(tmp_path, monkeypatch):
    checked = []
    real = format._checksum
    monkeypatch.setattr(format, "_checksum", lambda *a: checked.append(1) or real(*a))
    store = KVStore(tmp_path, memory_bytes=0)
    key = store.put(make_blob())
    checked.clear()
    for _ in range(3):
        assert store.get(key, FP) is not None
    assert len(checked) == 1  # the first read of this version
    path = store.disk.path(key)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))  # a new version of the file
    store.get(key, FP)
    assert len(checked) == 2
    assert store.verify() == {} and len(checked) == 3  # verify checks now, whatever came before
