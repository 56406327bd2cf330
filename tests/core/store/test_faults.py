"""Faults on real files and real processes: full disks, denied writes, racing and killed writers."""

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from turborag_integrations.core.prefill.blob import ChunkEncoder, KVBlob, fingerprint_model
from turborag_integrations.core.store import KVStore, StoreWriteError
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def blob():
    loaded = tiny_model("llama")
    fp = fingerprint_model(loaded.model, loaded.tokenizer, loaded.name)
    small = ChunkEncoder(loaded.model, loaded.tokenizer, fp).encode("a chunk of text")
    # A blob of a few MB, so that writes take long enough to race and to be killed mid-way.
    big = torch.randn(2, 2, 4096, 32)
    return KVBlob(torch.arange(4096), big, big.clone(), fp), small


def test_disk_full_gives_clear_error_and_leaves_nothing(tmp_path, blob):
    big, _ = blob
    mnt = tmp_path / "full"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root) to fill a disk")
    try:
        # A budget above the disk's size, so that the disk, not the budget, says no.
        store = KVStore(mnt / "kv", memory_bytes=0, disk_bytes="1GiB")
        with pytest.raises(StoreWriteError, match="disk is full"):
            store.put(big)
        leftovers = [p for p in (mnt / "kv").rglob("*") if p.is_file()]
        assert leftovers == []
        assert not store.contains(big.key)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _put_as_nobody(root, blob_path):
    os.setgid(65534)
    os.setuid(65534)
    from turborag_integrations.core.store import KVStore as Store
    store = Store(root, memory_bytes=0)
    blob = torch.load(blob_path, weights_only=False)
    try:
        store.put(blob)
    except StoreWriteError as exc:
        sys.exit(3 if "permission denied" in str(exc) else 4)
    except Exception:
        sys.exit(5)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged user needs root")
def test_permission_denied_gives_clear_error(blob):
    import shutil
    import tempfile
    _, small = blob
    base = tempfile.mkdtemp()  # pytest's own tmp folders are private to root
    os.chmod(base, 0o755)
    root = os.path.join(base, "kv")
    KVStore(root)  # created by root, not writable by others
    blob_path = os.path.join(base, "blob.pt")
    torch.save(small, blob_path)
    os.chmod(blob_path, 0o644)
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_put_as_nobody, args=(str(root), str(blob_path)))
    proc.start()
    proc.join(60)
    try:
        assert proc.exitcode == 3  # StoreWriteError saying "permission denied"
        assert not [f for _, _, files in os.walk(os.path.join(root, "blobs")) for f in files]
    finally:
        shutil.rmtree(base)


def _write_many(root, n, barrier):
    import pickle
    with open(os.path.join(root, "..", "blob.pkl"), "rb") as f:
        blob = pickle.load(f)
    store = KVStore(root, memory_bytes=0)
    barrier.wait()
    for _ in range(n):
        store.disk.put(blob.key, blob)  # always rewrite, to race on the same name


def test_two_processes_writing_one_key(tmp_path, blob):
    import pickle
    big, _ = blob
    root = tmp_path / "kv"
    KVStore(root)
    with open(tmp_path / "blob.pkl", "wb") as f:
        pickle.dump(big, f)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_write_many, args=(str(root), 15, barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    store = KVStore(root, memory_bytes=0)
    got = store.get(big.key, big.fingerprint)
    assert got is not None and torch.equal(got.keys, big.keys)
    assert [p.name for p in (root / "blobs").rglob("*") if p.is_file()] == [
        store.disk.path(big.key).name]


def _write_forever(root):
    import pickle
    with open(os.path.join(root, "..", "blob.pkl"), "rb") as f:
        blob = pickle.load(f)
    store = KVStore(root, memory_bytes=0)
    while True:
        store.disk.put(blob.key, blob)
        store.disk.delete(blob.key)


def test_killed_writer_never_leaves_a_valid_looking_partial_blob(tmp_path, blob):
    import pickle
    big, _ = blob
    root = tmp_path / "kv"
    KVStore(root)
    with open(tmp_path / "blob.pkl", "wb") as f:
        pickle.dump(big, f)
    ctx = mp.get_context("fork")
    for delay in (0.05, 0.13, 0.31):
        p = ctx.Process(target=_write_forever, args=(str(root),))
        p.start()
        time.sleep(delay)
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        store = KVStore(root, memory_bytes=0)
        got = store.get(big.key, big.fingerprint)
        # Either the whole blob is there or none is: never a truncated one that reads as valid.
        assert got is None or torch.equal(got.keys, big.keys)
        assert store.stats().corrupt == 0
        store.gc(keep=big.fingerprint, temp_older_than_s=0)  # sweeps a dead writer's temp file
        assert not [q for q in (root / "blobs").rglob(".tmp-*")]
