"""The Redis tier against a real redis-server: the tier contract, blobs shared by two stores, blobs
in parts, corrupted and lost entries, outages, and blobs of another model."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis
import torch

from turborag_integrations.core.errors import BlobCorrupted
from turborag_integrations.core.kv.blob import KVBlob
from turborag_integrations.core.store import KVStore
from turborag_integrations.core.store.redis_tier import RedisTier
# The contract test every tier passes, collected here again with the `tier` fixture below.
from tests.core.store.test_tiers import FP, TIERS, make_blob
from tests.core.store.test_tiers import test_every_tier_keeps_the_contract  # noqa: F401

LOGGER = "turborag_integrations.core.store.redis_tier"


class RedisServer:
    """A throwaway redis-server on a free loopback port, in its own folder, that keeps nothing
    (no snapshots, no append-only file). `stop` kills it as a crash would; `start` starts it
    again, empty, on the same port."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server): the Redis "
                    "tier is tested against a real server")
    with RedisServer(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture
def client(server):
    """A plain client of the shared server, which each test starts with empty."""
    plain = redis.Redis.from_url(server.url)
    plain.flushall()
    yield plain
    plain.close()


@pytest.fixture
def tier(server, client, monkeypatch, tmp_path):
    # The contract test checks the tier's name against the tiers it knows.
    monkeypatch.setitem(TIERS, "redis", lambda _: RedisTier(server.url))
    made = TIERS["redis"](tmp_path)
    yield made
    made.close()


def names(client) -> list[str]:
    return sorted(n.decode() for n in client.keys("*"))


def test_a_blob_written_by_one_store_is_a_hit_in_another(tmp_path, server, client, monkeypatch):
    a = KVStore(tmp_path / "a", remote_url=server.url)
    monkeypatch.setenv("TURBORAG_REDIS_URL", server.url)
    b = KVStore(tmp_path / "b")  # configured by the environment
    assert [t.name for t in b.tiers] == ["memory", "disk", "redis"]
    assert [t.name for t in KVStore(tmp_path / "c", remote_url="").tiers] == ["memory", "disk"]
    blob = make_blob()
    key = a.put(blob)
    assert a.stats().writes == 2  # disk and Redis
    assert not b.disk.contains(key)

    got = b.get(key, FP)
    assert torch.equal(got.keys, blob.keys) and torch.equal(got.values, blob.values)
    assert torch.equal(got.token_ids, blob.token_ids) and got.fingerprint == FP
    assert b.stats().other_hits == {"redis": 1}
    assert b.disk.contains(key) and b.memory.contains(key)  # promoted on the way back
    assert b.get(key, FP) is not None and b.stats().memory_hits == 1
    assert b.keys() == a.keys() == [key]
    a.close()
    b.close()


def test_a_blob_larger_than_a_part_round_trips_in_parts(client, server):
    tier = RedisTier(server.url, part_bytes=4096, ttl_s=3600)
    blob = make_blob(tokens=64)
    held = tier.put(blob.key, blob)
    assert held > 4 * 4096
    parts = [n for n in names(client) if n != f"turborag:kv:{blob.key}"]
    assert len(parts) == -(-held // 4096) and all(len(client.get(p)) <= 4096 for p in parts)
    assert tier.keys() == [blob.key]  # the parts are not keys of blobs
    assert all(0 < client.ttl(n) <= 3600 for n in names(client))  # parts expire with the blob

    got = tier.get(blob.key)
    assert torch.equal(got.keys, blob.keys) and torch.equal(got.values, blob.values)
    assert tier.delete(blob.key) and names(client) == []
    tier.close()


def test_without_a_ttl_a_published_blob_does_not_expire(client, server):
    tier = RedisTier(server.url, part_bytes=4096)
    blob = make_blob(tokens=64)
    tier.put(blob.key, blob)
    assert {client.ttl(n) for n in names(client)} == {-1}  # the parts' write-time expiry is gone


def corrupt_a_part(client) -> None:
    part = next(n for n in names(client) if n.count(":") > 2)
    value = bytearray(client.get(part))
    value[-10] ^= 0xFF  # a bit flip inside the tensor data
    client.set(part, bytes(value))


@pytest.mark.parametrize("damage", ["part", "manifest"])
def test_a_corrupted_entry_is_a_miss_and_is_deleted(tmp_path, client, server, damage):
    writer = KVStore(tmp_path / "a", remote_url=server.url)
    key = writer.put(make_blob())
    if damage == "part":
        corrupt_a_part(client)
    else:
        client.set(f"turborag:kv:{key}", b'{"format": "turborag-redis-1", "parts": 1e9}')
    reader = KVStore(tmp_path / "b", remote_url=server.url)
    assert reader.get(key, FP) is None
    stats = reader.stats()
    assert stats.corrupt == 1 and stats.misses == 1 and stats.other_hits == {}
    assert names(client) == [] and not reader.disk.contains(key)
    assert writer.get(key, FP) is not None  # the writer's own disk copy is sound


def test_a_lost_part_is_a_miss_and_the_blob_can_be_written_again(client, server):
    tier = RedisTier(server.url, part_bytes=4096)
    blob = make_blob(tokens=64)
    tier.put(blob.key, blob)
    client.delete(next(n for n in names(client) if n.endswith(":0")))  # as maxmemory would
    assert tier.get(blob.key) is None
    assert not tier.contains(blob.key) and names(client) == []  # the rest is dropped
    assert tier.put(blob.key, blob) > 0 and tier.get(blob.key) is not None


def test_a_blob_of_another_fingerprint_is_never_returned(tmp_path, client, server):
    tier = RedisTier(server.url)
    store = KVStore(tmp_path, memory_bytes=0, tiers=[tier])
    mine = make_blob()
    theirs = make_blob()
    theirs = KVBlob(theirs.token_ids, theirs.keys, theirs.values, replace(FP, weights="other"))
    tier.put(mine.key, theirs)  # another model's blob under this model's key
    assert store.get(mine.key, FP) is None
    assert store.stats().fingerprint_rejects == 1 and not store.disk.contains(mine.key)


def test_an_entry_under_another_key_is_corrupt(client, server):
    tier = RedisTier(server.url)
    blob, other = make_blob(), make_blob(100)
    tier.put(blob.key, blob)
    for name in names(client):  # the same bytes, renamed to another blob's key
        client.rename(name, name.replace(blob.key, other.key))
    with pytest.raises(BlobCorrupted, match="holds the blob of key"):
        tier.get(other.key)


def redis_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


def test_a_redis_outage_costs_one_warning_and_misses_then_it_is_used_again(tmp_path, caplog):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    caplog.set_level(logging.INFO, logger=LOGGER)
    with RedisServer(tmp_path / "redis") as server:
        store = KVStore(tmp_path / "kv", memory_bytes=0,
                        tiers=[RedisTier(server.url, retry_after_s=0.2)])
        before = store.put(make_blob())
        server.stop()

        for n in range(1, 6):  # writes and reads go on from the disk, without errors
            blob = make_blob(100 * n)
            assert store.put(blob) == blob.key and store.get(blob.key, FP) is not None
            assert store.get(make_blob(1000 + n).key, FP) is None  # a miss everywhere
            time.sleep(0.05)  # some of these calls try Redis again, and fail again
        assert store.get(before, FP) is not None and store.stats().disk_hits == 6
        [warning] = redis_warnings(caplog)
        assert server.url in warning and "running and reachable" in warning

        server.start()  # empty, on the same port
        time.sleep(0.25)  # past retry_after_s
        after = store.put(make_blob(7000))
        check = redis.Redis.from_url(server.url)
        assert check.exists(f"turborag:kv:{after}") == 1
        assert store.keys() == sorted({before, after, *(make_blob(100 * n).key
                                                        for n in range(1, 6))})
        assert len(redis_warnings(caplog)) == 1
        assert any("answers again" in r.getMessage() for r in caplog.records)
        check.close()
        store.close()


def test_a_stalled_redis_costs_one_timeout_then_is_skipped(tmp_path, caplog):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with RedisServer(tmp_path / "redis") as server:
        tier = RedisTier(server.url, socket_timeout_s=0.3, retry_after_s=60)
        blob = make_blob()
        tier.put(blob.key, blob)
        server.process.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            start = time.monotonic()
            assert [tier.get(blob.key) for _ in range(20)] == [None] * 20
            assert not tier.contains(blob.key) and tier.put(blob.key, blob) == 0
            assert tier.keys() == [] and tier.delete(blob.key) is False
            assert time.monotonic() - start < 1.5  # one timeout, not one per call
            assert len(redis_warnings(caplog)) == 1
        finally:
            server.process.send_signal(signal.SIGCONT)
        tier.close()


def test_threads_share_one_tier(client, server):
    tier = RedisTier(server.url, part_bytes=2048)
    blobs = [make_blob(100 * n, tokens=32) for n in range(16)]
    errors = []

    def work(mine):
        try:
            for blob in mine:
                tier.put(blob.key, blob)
                assert torch.equal(tier.get(blob.key).keys, blob.keys)
        except Exception as exc:  # kept, so that the test fails in its own thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(blobs[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(tier.keys()) == sorted(b.key for b in blobs)
    tier.close()


def test_prefix_blobs_stay_on_the_local_disk(tmp_path, server, client):
    store = KVStore(tmp_path / "a", remote_url=server.url)
    key = store.put(make_blob(), kind="prefix")
    assert store.disk.contains(key)
    assert not store.tiers[-1].contains(key)  # a prompt head is not shipped to Redis
    store.close()


def test_peek_reads_a_few_ranges_of_the_parts_not_the_blob(client, server):
    tier = RedisTier(server.url, part_bytes=256)  # the header and the ids straddle parts
    blob = make_blob(7, tokens=64)
    tier.put(blob.key, blob)
    found = tier.peek(blob.key)
    assert found.fingerprint == FP and found.token_ids == tuple(range(7, 71))
    # Damage the keys and values (the last part): a peek never reads them, a get does.
    parts = [n for n in names(client) if n.count(":") > 2]
    last = max(parts, key=lambda n: int(n.rsplit(":", 1)[1]))
    client.set(last, bytes(len(client.get(last))))
    assert tier.peek(blob.key).token_ids == tuple(range(7, 71))
    with pytest.raises(BlobCorrupted):
        tier.get(blob.key)


def test_peek_through_a_store_reads_redis_without_promoting(tmp_path, client, server):
    writer = KVStore(tmp_path / "a", remote_url=server.url)
    key = writer.put(make_blob(3))
    reader = KVStore(tmp_path / "b", remote_url=server.url)
    assert reader.peek(key).token_ids == tuple(range(3, 11))
    assert not reader.disk.contains(key) and not reader.memory.contains(key)
    assert reader.stats().other_hits == {}


def test_peek_of_a_lost_part_or_an_absent_blob_is_a_miss(client, server):
    tier = RedisTier(server.url, part_bytes=256)
    blob = make_blob(tokens=64)
    assert tier.peek(blob.key) is None
    tier.put(blob.key, blob)
    client.delete(next(n for n in names(client) if n.endswith(":0")))
    assert tier.peek(blob.key) is None
    assert client.exists(f"turborag:kv:{blob.key}")  # a peek drops nothing; a get would


def test_peek_while_redis_is_down_is_a_miss(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    with RedisServer(tmp_path / "redis") as running:
        tier = RedisTier(running.url, retry_after_s=60)
        blob = make_blob()
        tier.put(blob.key, blob)
    assert tier.peek(blob.key) is None  # the server is gone: one failure, then skipped
    tier.close()


def test_replace_rewrites_the_shared_entry(tmp_path, server, client):
    """The Redis tier keeps an entry's first write; put(replace=True) puts the new blob there,
    so that another store reads the new one."""
    a = KVStore(tmp_path / "a", remote_url=server.url)
    old, new = make_blob(), make_blob()
    new.base_position = 9
    key = a.put(old)
    a.put(new, replace=True)
    got = KVStore(tmp_path / "b", remote_url=server.url).get(key, FP)
    assert torch.equal(got.keys, new.keys) and got.base_position == 9
    a.close()
