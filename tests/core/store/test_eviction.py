"""The disk tier's byte budget: prefix blobs bounded apart, hot blobs kept, cold ones evicted,
several processes sharing one store, and the sizes and defaults that set the bounds."""

import logging
import multiprocessing as mp

import pytest
import torch

from turborag_integrations.core.kv.blob import Fingerprint, KVBlob
from turborag_integrations.core.store import KVStore, budget
from turborag_integrations.core.store.access import AccessLog
from turborag_integrations.core.store.budget import parse_size

FP = Fingerprint(model="test", config="c", weights="w", tokenizer="t", dtype="float32")


def make_blob(n: int = 0, tokens: int = 8) -> KVBlob:
    """A small synthetic blob; distinct n, distinct key."""
    keys = torch.randn(2, 2, tokens, 16)
    return KVBlob(torch.arange(n * tokens, (n + 1) * tokens), keys, keys * 2, FP)


@pytest.fixture(scope="module")
def blob_bytes(tmp_path_factory):
    """Bytes of one make_blob() on disk."""
    store = KVStore(tmp_path_factory.mktemp("size"), memory_bytes=0)
    store.put(make_blob())
    return store.disk_usage()["bytes"]


def files_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.kv.safetensors"))


def test_a_thousand_chat_turns_stay_within_the_prefix_budget(tmp_path, blob_bytes):
    prefix_budget = 8 * blob_bytes
    store = KVStore(tmp_path, memory_bytes=0, disk_bytes=1000 * blob_bytes,
                    prefix_bytes=prefix_budget)
    chunk = store.put(make_blob(0))
    for turn in range(1, 1001):  # every turn a new prompt head, never asked for again
        store.put(make_blob(turn), kind="prefix")
        assert files_bytes(tmp_path / "prefixes") <= prefix_budget
    assert store.disk.contains(chunk)  # the prefix bound never touches chunk blobs
    assert store.stats().disk_evictions >= 990
    assert store.disk.contains(make_blob(1000).key)  # the newest turn is kept


def test_hot_chunk_blobs_survive_and_cold_ones_are_evicted(tmp_path, blob_bytes):
    budget_bytes = 10 * blob_bytes
    # With a memory tier, reads after the first are memory hits: the disk tier must hear of them.
    store = KVStore(tmp_path, memory_bytes=1 << 20, disk_bytes=budget_bytes)
    hot = [store.put(make_blob(i)) for i in range(4)]
    for _ in range(5):
        for key in hot:
            assert store.get(key, FP) is not None
    cold = [store.put(make_blob(100 + i)) for i in range(30)]  # a scan of new chunks
    assert all(store.disk.contains(key) for key in hot)
    assert sum(store.disk.contains(key) for key in cold) <= 6
    assert store.disk.contains(cold[-1])
    assert files_bytes(tmp_path / "blobs") <= budget_bytes


def _read_hot(root, keys):
    store = KVStore(root, memory_bytes=0)
    for _ in range(3):
        for key in keys:
            assert store.get(key, FP) is not None
    store.close()  # writes out the recorded reads


def test_reads_of_another_process_count(tmp_path, blob_bytes):
    store = KVStore(tmp_path, memory_bytes=0, disk_bytes=6 * blob_bytes)
    old = [store.put(make_blob(i)) for i in range(4)]
    ctx = mp.get_context("fork")
    reader = ctx.Process(target=_read_hot, args=(str(tmp_path), old[:2]))
    reader.start()
    reader.join(60)
    assert reader.exitcode == 0
    for i in range(10):
        store.put(make_blob(100 + i))
    assert store.disk.contains(old[0]) and store.disk.contains(old[1])
    assert not store.disk.contains(old[2]) and not store.disk.contains(old[3])


def _put_prefixes(root, first, n, limit):
    store = KVStore(root, memory_bytes=0, prefix_bytes=limit)
    for i in range(first, first + n):
        store.put(make_blob(i), kind="prefix")
    store.close()


def test_two_processes_writing_prefixes_share_one_budget(tmp_path, blob_bytes):
    limit = 10 * blob_bytes
    KVStore(tmp_path)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_put_prefixes, args=(str(tmp_path), 1000 * w, 150, limit))
             for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    # Each writer can run over by what it writes between its passes: a tenth of the bound.
    assert files_bytes(tmp_path / "prefixes") <= limit + 2 * (limit // 10 + blob_bytes)
    assert not list(tmp_path.rglob(".tmp-*"))
    store = KVStore(tmp_path, memory_bytes=0)
    assert store.verify() == {}  # every blob left is whole


def test_a_blob_evicted_while_mapped_stays_readable(tmp_path):
    store = KVStore(tmp_path, memory_bytes=0)
    blob = make_blob()
    key = store.put(blob)
    got = store.get(key, FP)  # views of a memory map of the file
    assert store.shrink(0) == [key] and not store.contains(key)
    # Unlinking leaves a mapped file's data in place until the last map goes (POSIX).
    assert torch.equal(got.keys, blob.keys) and torch.equal(got.values, blob.values)
    assert store.get(key, FP) is None  # a later reader: a plain miss


def test_shrink_removes_the_coldest_of_both_kinds(tmp_path, blob_bytes):
    store = KVStore(tmp_path, memory_bytes=0)
    keys = [store.put(make_blob(i)) for i in range(6)]
    heads = [store.put(make_blob(100 + i), kind="prefix") for i in range(4)]
    for _ in range(2):
        store.get(keys[0], FP)
    removed = store.shrink(f"{3 * blob_bytes}B")
    assert store.disk_usage()["bytes"] <= 3 * blob_bytes
    assert keys[0] not in removed and store.contains(keys[0])
    assert set(removed) == set(keys + heads) - set(store.keys())


def test_deleting_a_document_still_deletes_its_blobs(tmp_path):
    store = KVStore(tmp_path, memory_bytes=0, disk_bytes="1MB")
    key = store.put(make_blob(), doc_id="a.md")
    head = store.put(make_blob(1), kind="prefix")
    assert store.delete_doc("a.md") == [key]
    assert not store.contains(key) and store.contains(head)  # a prefix belongs to no document


def test_a_blob_over_its_bound_is_declined_with_a_warning(tmp_path, caplog):
    store = KVStore(tmp_path, memory_bytes=0, prefix_bytes=100)
    with caplog.at_level(logging.WARNING):
        key = store.put(make_blob(), kind="prefix")
    assert not store.contains(key) and store.stats().writes == 0
    assert "TURBORAG_STORE_PREFIX_BYTES" in caplog.text


def test_an_unknown_kind_is_refused(tmp_path):
    with pytest.raises(ValueError, match="chunk"):
        KVStore(tmp_path).put(make_blob(), kind="head")


def test_prompt_heads_and_chunks_land_in_their_own_folders(tmp_path, tiny_llama):
    from turborag_integrations.core.engine import TurboRAGEngine

    engine = TurboRAGEngine(tiny_llama, store=tmp_path, progress=False)
    head = engine.library.prefix_blob("System: answer briefly.\nContext:\n")
    chunk = engine.library.blob_for("The ferry stops in January.", encode_missing=True)
    assert engine.store.disk.path(head.key) == engine.store.disk.path(head.key, "prefix")
    assert engine.store.disk.path(chunk.key) == engine.store.disk.path(chunk.key, "chunk")
    assert engine.store.disk.path(head.key).exists() and engine.store.disk.path(chunk.key).exists()


def test_rapid_stores_its_document_prefix_as_a_prefix(tmp_path, tiny_llama):
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.rapid import RapidEngine
    from turborag_integrations.core.settings import GenerationConfig

    target = TurboRAGEngine(tiny_llama, store=tmp_path, progress=False)
    RapidEngine(target, gamma=2).generate(
        "The lighthouse stands 41 metres high.\n\nThe ferry stops in January.",
        "How high is the lighthouse?", chunks=["The lighthouse stands 41 metres high."],
        config=GenerationConfig(max_new_tokens=2))
    assert list((tmp_path / "prefixes").rglob("*.kv.safetensors"))


# ---- the access log ---------------------------------------------------------------------------

def test_the_access_log_sums_reads_and_compaction_halves_them(tmp_path):
    access = AccessLog(tmp_path / "access.log")
    for key, reads in (("a", 4), ("b", 1)):
        for _ in range(reads):
            access.note(key)
    access.flush()
    with open(tmp_path / "access.log", "a") as f:
        f.write("c 1")  # a torn append is skipped
    uses = access.read()
    assert {k: n for k, (n, _) in uses.items()} == {"a": 4, "b": 1}
    access.compact()
    assert {k: n for k, (n, _) in access.read().items()} == {"a": 2}  # b faded out


# ---- sizes and defaults -----------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("2GB", 2 * 10**9), ("2GiB", 2 << 30), ("2G", 2 << 30), ("1.5 TB", 1.5e12),
    ("500MiB", 500 << 20), ("10kb", 10_000), (123, 123)])
def test_sizes_are_read_the_way_people_write_them(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "2 GBs", "-1", "", "1e9"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(ValueError, match="not a size"):
        parse_size(text)


def test_budgets_come_from_arguments_then_environment_then_defaults(tmp_path, monkeypatch):
    monkeypatch.delenv(budget.ENV_DISK, raising=False)
    monkeypatch.delenv(budget.ENV_PREFIX, raising=False)
    monkeypatch.setattr("turborag_integrations.core.store.disk.shutil.disk_usage",
                        lambda path: type("Usage", (), {"free": 40 << 30})())
    assert KVStore(tmp_path / "a").disk.budget() == (20 << 30, 2 << 30)
    monkeypatch.setattr("turborag_integrations.core.store.disk.shutil.disk_usage",
                        lambda path: type("Usage", (), {"free": 10 << 40})())
    assert KVStore(tmp_path / "b").disk.budget() == (budget.DISK_CAP, budget.PREFIX_CAP)
    monkeypatch.setenv(budget.ENV_DISK, "5GB")
    monkeypatch.setenv(budget.ENV_PREFIX, "1GB")
    assert KVStore(tmp_path / "c").disk.budget() == (5 * 10**9, 10**9)
    assert KVStore(tmp_path / "d", disk_bytes=1000, prefix_bytes=5000).disk.budget() == (1000, 1000)
    monkeypatch.setenv(budget.ENV_DISK, "plenty")
    with pytest.raises(ValueError, match=budget.ENV_DISK):
        KVStore(tmp_path / "e")
