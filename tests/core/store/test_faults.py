"""Faults on real files and real processes: full disks and file size limits, a read-only store,
racing and killed writers, a blob file under another blob's name, and a fine-tuned model.

docs/kv_store.md#faults lists every fault tried and the test that provokes it (test_fault_table.py
checks that the tests it names exist).
"""

import errno
import logging
import multiprocessing as mp
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from turborag_integrations.core.prefill.chunk_encoder import ChunkEncoder
from turborag_integrations.core.kv.blob import KVBlob, fingerprint_model
from turborag_integrations.core.store import KVStore, StoreWriteError
from turborag_integrations.core.store.files import write_atomically
from tests.conftest import tiny_model
from tests.core.store.test_tiers import DictTier

NOBODY = 65534  # the unprivileged user a root test run drops to


@pytest.fixture(scope="module")
def blob():
    loaded = tiny_model("llama")
    fp = fingerprint_model(loaded.model, loaded.tokenizer, loaded.name)
    small = ChunkEncoder(loaded.model, loaded.tokenizer, fp).encode("a chunk of text")
    # A blob of a few MB, so that writes take long enough to race and to be killed mid-way.
    big = torch.randn(2, 2, 4096, 32)
    return KVBlob(torch.arange(4096), big, big.clone(), fp), small


def blob_files(root) -> list[str]:
    """Every file under the blob folders, temp files included, by name."""
    return sorted(p.name for folder in ("blobs", "prefixes") for p in (root / folder).rglob("*")
                  if p.is_file())


@contextmanager
def small_disk(folder, size: str):
    """A tmpfs of `size` mounted on folder: a real file system that fills up."""
    folder.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root); "
                    "test_a_write_over_the_file_size_limit_fails_clearly fails a write without it")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_disk_full_gives_clear_error_and_loses_nothing(tmp_path, blob, caplog):
    big, small = blob
    with small_disk(tmp_path / "full", "256k") as mnt:
        remote = DictTier()
        # A budget above the disk's size, so that the disk, not the budget, says no.
        store = KVStore(mnt / "kv", memory_bytes=0, disk_bytes="1GiB", tiers=[remote])
        kept = store.put(small)
        with pytest.raises(StoreWriteError, match="the disk is full. Free space") as raised:
            store.put(big)
        assert raised.value.errno == errno.ENOSPC
        assert blob_files(mnt / "kv") == [store.disk.path(kept).name]  # no temp file left
        assert not store.contains(big.key)  # nor written to the tier after the disk
        assert torch.equal(store.get(kept, small.fingerprint).keys, small.keys)

        # A hit in a slower tier is served even though no copy fits on the full disk.
        remote.items[big.key] = big
        with caplog.at_level(logging.WARNING):
            got = store.get(big.key, big.fingerprint)
        assert got is not None and torch.equal(got.keys, big.keys)
        assert store.stats().other_hits == {"remote": 1}
        assert "could not copy KV blob" in caplog.text and "into the disk tier" in caplog.text
        assert blob_files(mnt / "kv") == [store.disk.path(kept).name]
        store.close()


def _put_under_a_file_size_limit(root, limit, blobs, conn):
    # Without this the kernel kills a process that writes past its limit (Python ignores the
    # signal already; said here so that the test does not depend on it).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    store = KVStore(root, memory_bytes=0, disk_bytes="1GiB")
    outcomes = []
    for b in blobs:
        try:
            outcomes.append(("stored", store.put(b)))
        except StoreWriteError as exc:
            outcomes.append((exc.errno, str(exc)))
    conn.send(outcomes)


def test_a_write_over_the_file_size_limit_fails_clearly(tmp_path, blob):
    """The write fails mid-file (EFBIG under RLIMIT_FSIZE): what a full disk does to a write,
    without root to mount one."""
    big, small = blob
    root = tmp_path / "kv"
    ctx = mp.get_context("fork")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_put_under_a_file_size_limit, args=(root, 1 << 20, [big, small], theirs))
    proc.start()
    assert ours.poll(60)
    (failed, message), (stored, key) = ours.recv()
    proc.join(10)
    assert proc.exitcode == 0
    assert failed == errno.EFBIG
    assert "larger than this process may write" in message and "Raise that limit" in message
    assert (stored, key) == ("stored", small.key)  # a blob under the limit is still written
    store = KVStore(root, memory_bytes=0)
    assert blob_files(root) == [store.disk.path(small.key).name]  # nothing of the big one
    assert torch.equal(store.get(small.key, small.fingerprint).keys, small.keys)


def _use_read_only_store(root, kept, new, uid, conn):
    if uid is not None:
        os.setgid(uid)
        os.setuid(uid)
    store = KVStore(root, memory_bytes=0)
    got = store.get(kept.key, kept.fingerprint)
    read = got is not None and torch.equal(got.keys, kept.keys)
    try:
        store.put(new)
        error = None
    except StoreWriteError as exc:
        error = (exc.errno, str(exc))
    store.close()  # the access log cannot be written: not an error
    conn.send((read, error))


def test_a_read_only_store_serves_reads_and_refuses_writes_clearly(blob):
    big, small = blob
    base = tempfile.mkdtemp()  # not pytest's tmp_path: a root run's is private to root
    os.chmod(base, 0o755)
    root = Path(base) / "kv"
    try:
        with KVStore(root, memory_bytes=0) as store:
            store.put(small)
        # Root ignores permission bits: a root run hands the store to an unprivileged user,
        # who opens it as its read-only owner, as any user would.
        uid = NOBODY if os.geteuid() == 0 else None
        for folder, dirs, files in os.walk(root):
            if uid is not None:
                os.chown(folder, uid, uid)
                for name in files:
                    os.chown(os.path.join(folder, name), uid, uid)
            os.chmod(folder, 0o555)
            for name in files:
                os.chmod(os.path.join(folder, name), 0o444)
        before = blob_files(root)
        ctx = mp.get_context("fork")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_use_read_only_store, args=(root, small, big, uid, theirs))
        proc.start()
        assert ours.poll(60)
        read, error = ours.recv()
        proc.join(10)
        assert proc.exitcode == 0
        assert read  # the stored blob is served
        assert error is not None and error[0] == errno.EACCES
        assert "permission denied" in error[1] and "choose another store folder" in error[1]
        assert blob_files(root) == before  # no temp file, no partial blob
    finally:
        for folder, _, _ in os.walk(base):
            os.chmod(folder, 0o755)
        shutil.rmtree(base)


def _rewrite(root, blob, n, barrier):
    store = KVStore(root, memory_bytes=0)
    barrier.wait()
    for _ in range(n):
        store.disk.put(blob.key, blob)  # always rewrite, to race on the same name


def test_two_processes_writing_one_key(tmp_path, blob):
    big, _ = blob
    root = tmp_path / "kv"
    KVStore(root)
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_rewrite, args=(root, big, 15, barrier)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    store = KVStore(root, memory_bytes=0)
    got = store.get(big.key, big.fingerprint)
    assert got is not None and torch.equal(got.keys, big.keys)
    assert blob_files(root) == [store.disk.path(big.key).name]


def _write_and_delete_forever(root, blob):
    store = KVStore(root, memory_bytes=0)
    while True:
        store.disk.put(blob.key, blob)
        store.disk.delete(blob.key)


def test_killed_writer_never_leaves_a_valid_looking_partial_blob(tmp_path, blob):
    big, _ = blob
    root = tmp_path / "kv"
    KVStore(root)
    ctx = mp.get_context("fork")
    for delay in (0.05, 0.13, 0.31):  # whatever the writer was doing at that moment
        p = ctx.Process(target=_write_and_delete_forever, args=(root, big))
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


def _write_half_then_hang(target, payload, half_written):
    def halves():
        yield payload[: len(payload) // 2]
        half_written.set()
        time.sleep(60)  # killed here
        yield payload[len(payload) // 2:]

    write_atomically(target, halves())  # how the disk tier writes every blob


@pytest.mark.parametrize("old_version", [True, False], ids=["rewrite", "first-write"])
def test_a_writer_killed_mid_write_leaves_the_old_file_or_none(tmp_path, blob, old_version):
    big, _ = blob
    store = KVStore(tmp_path, memory_bytes=0)
    store.put(big)
    target = store.disk.path(big.key)
    payload = target.read_bytes()
    if not old_version:
        store.delete(big.key)
    ctx = mp.get_context("fork")
    half_written = ctx.Event()
    proc = ctx.Process(target=_write_half_then_hang, args=(target, payload, half_written))
    proc.start()
    assert half_written.wait(60)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    [temp] = target.parent.glob(".tmp-*")
    assert temp.stat().st_size == len(payload) // 2  # killed with half the file written

    reader = KVStore(tmp_path, memory_bytes=0)
    got = reader.get(big.key, big.fingerprint)
    if old_version:
        assert got is not None and torch.equal(got.keys, big.keys)
    else:
        assert got is None and reader.keys() == []  # a plain miss: the temp file is no blob
    assert reader.stats().corrupt == 0
    reader.gc(keep=big.fingerprint)  # a young temp file may be a live writer's: kept
    assert temp.exists()
    reader.gc(keep=big.fingerprint, temp_older_than_s=0)
    assert not temp.exists() and reader.keys() == ([big.key] if old_version else [])


def test_a_blob_file_under_another_blobs_name_is_a_miss(tmp_path, blob):
    _, small = blob
    fp = small.fingerprint
    other = KVBlob(small.token_ids + 1, small.keys * 2, small.values * 2, fp)
    store = KVStore(tmp_path, memory_bytes=0)
    mine, theirs = store.put(small), store.put(other)
    # A sound file (its checksum passes) copied over another chunk's blob of the same model.
    shutil.copyfile(store.disk.path(mine), store.disk.path(theirs))
    assert store.get(theirs, fp) is None
    assert store.stats().corrupt == 1 and not store.disk.contains(theirs)
    assert torch.equal(store.get(mine, fp).keys, small.keys)


def test_a_fine_tuned_model_never_reads_the_base_models_blobs(tmp_path):
    loaded = tiny_model("llama")
    model, tokenizer = loaded.model, loaded.tokenizer
    base_fp = fingerprint_model(model, tokenizer, loaded.name)
    text = "Alice was born in Paris in 1901."
    base = ChunkEncoder(model, tokenizer, base_fp).encode(text)
    store = KVStore(tmp_path, memory_bytes=0)
    base_key = store.put(base)

    # One step of full fine-tuning: same architecture, name and tokenizer; other weights.
    ids = base.token_ids[None]
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 1e-3 * p.grad
    model.eval()
    tuned_fp = fingerprint_model(model, tokenizer, loaded.name)
    assert (tuned_fp.model, tuned_fp.config, tuned_fp.tokenizer) == (
        base_fp.model, base_fp.config, base_fp.tokenizer)
    assert tuned_fp.weights != base_fp.weights

    tuned = ChunkEncoder(model, tokenizer, tuned_fp).encode(text)
    assert not torch.equal(tuned.keys, base.keys)  # the base blob would be wrong for it
    assert tuned.key != base_key and store.get(tuned.key, tuned_fp) is None  # a miss: re-encoded
    assert store.get(base_key, tuned_fp) is None  # and the base blob is refused even if asked for
    assert store.stats().fingerprint_rejects == 1
    store.put(tuned)
    assert torch.equal(store.get(base_key, base_fp).keys, base.keys)  # the base model keeps its own
    assert torch.equal(store.get(tuned.key, tuned_fp).keys, tuned.keys)


def test_a_full_disk_costs_the_cache_not_the_answer(tmp_path, caplog):
    """A query whose chunk and prompt-head blobs cannot be written still gets its answer (the
    KV is computed already), with a warning, and the same answer as with room on the disk."""
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.settings import GenerationConfig
    from tests.conftest import tiny_model

    loaded = tiny_model("llama")
    chunks = ["Alice was born in Paris in 1901. " * 4, "Bob keeps three red bicycles. " * 4]
    prompt = "Answer from the notes.\n" + "".join(chunks) + "\nQ: where was Alice born?\nA:"
    config = GenerationConfig(max_new_tokens=12)
    expected = TurboRAGEngine(loaded, store=tmp_path / "roomy", progress=False).generate(
        prompt, chunks=chunks, config=config, encode_missing=True)
    with small_disk(tmp_path / "full", "64k") as mnt:
        # Budgets above the disk's size, so that the disk, not a budget, says no.
        store = KVStore(mnt / "kv", disk_bytes="1GiB", prefix_bytes="1GiB")
        engine = TurboRAGEngine(loaded, store=store, progress=False)
        with open(mnt / "filler", "wb", buffering=0) as filler:  # fill it to the last byte
            try:
                while True:
                    filler.write(b"\0" * 512)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        with caplog.at_level(logging.WARNING):
            got = engine.generate(prompt, chunks=chunks, config=config, encode_missing=True)
        assert got.token_ids == expected.token_ids
        assert got.stats.reused_tokens == expected.stats.reused_tokens > 0
        assert "not stored, the answer goes on without caching it" in caplog.text
        assert "disk is full" in caplog.text
        engine.store.close()
