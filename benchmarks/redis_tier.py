"""Redis tier: is a hit from Redis faster than recomputing the chunk's KV?

    python benchmarks/redis_tier.py            # table
    python benchmarks/redis_tier.py --json     # one JSON object

For the bundled model and chunks of 512 and 2048 tokens, the median time of:

- recompute: encoding the chunk's KV (`engine.library.encoder.encode`), what a miss costs;
- redis hit: `RedisTier.get` from a redis-server started on this machine (loopback, so no
  network): fetch the parts, check the checksum, decode into a blob;
- disk hit: `KVStore.get` with no memory tier, from a store that has not read the blob yet (so
  the checksum is checked, as it always is for Redis), with the page cache dropped first (cold)
  and kept (warm);

and recompute / redis hit: above 1, a Redis hit beats recomputing the chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import make_chunks  # noqa: E402

from tests.core.store.test_redis_tier import RedisServer  # noqa: E402
from turborag_integrations.core.engine import TurboRAGEngine  # noqa: E402
from turborag_integrations.core.store import KVStore  # noqa: E402
from turborag_integrations.core.store.redis_tier import RedisTier  # noqa: E402


def median_s(fn, runs: int, before=lambda: None) -> float:
    """Median wall time of fn() over `runs` calls, after an untimed one; `before()` runs, untimed,
    ahead of each call."""
    times = []
    for _ in range(runs + 1):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first call warms up


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(engine: TurboRAGEngine, tier: RedisTier, folder: Path, tokens: int,
            runs: int) -> dict:
    [text] = make_chunks(engine.tokenizer, 1, tokens)
    blob = engine.library.encoder.encode(text)
    key = blob.key
    held = tier.put(key, blob)
    with KVStore(folder, memory_bytes=0, remote_url="") as store:
        store.put(blob)
        path = store.disk.path(key)

    opened: list[KVStore] = []

    def open_store(cold: bool):
        # A store of its own for each read (opened untimed): it has not checked this blob's
        # checksum yet, as a worker that reads it the first time.
        if opened:
            opened.pop().close()
        if cold:
            drop_page_cache(path)
        opened.append(KVStore(folder, memory_bytes=0, remote_url=""))

    def disk_hit():
        assert opened[-1].get(key, engine.fingerprint) is not None

    def redis_hit():
        got = tier.get(key)
        assert got is not None and got.fingerprint == engine.fingerprint

    assert torch.equal(tier.get(key).keys, blob.keys)
    out = {"tokens": blob.num_tokens, "blob_bytes": held,
           "recompute_s": median_s(lambda: engine.library.encoder.encode(text), runs),
           "redis_hit_s": median_s(redis_hit, runs),
           "disk_cold_s": median_s(disk_hit, runs, before=lambda: open_store(cold=True)),
           "disk_warm_s": median_s(disk_hit, runs, before=lambda: open_store(cold=False))}
    opened.pop().close()
    out["recompute_over_redis"] = out["recompute_s"] / out["redis_hit_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("redis-server is not installed (apt-get install redis-server)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        engine = TurboRAGEngine(store=KVStore(Path(tmp) / "engine", remote_url=""),
                                progress=not args.json)
        server = RedisServer(Path(tmp) / "redis").start()
        tier = RedisTier(server.url)
        try:
            rows = [measure(engine, tier, Path(tmp) / f"disk-{n}", n, args.runs)
                    for n in args.tokens]
        finally:
            tier.close()
            server.stop()
    out = {"model": engine.loaded.name, "dtype": engine.fingerprint.dtype,
           "storage_dtype": tier.storage_dtype, "runs": args.runs,
           "torch_threads": torch.get_num_threads(), "rows": rows}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"model {out['model']} ({out['dtype']}, blobs stored {out['storage_dtype']}), "
          f"{out['torch_threads']} torch threads; medians of {args.runs} runs; "
          f"redis-server on loopback")
    print(f"{'tokens':>6} {'blob MB':>8} {'recompute ms':>13} {'redis hit ms':>13} "
          f"{'disk cold ms':>13} {'disk warm ms':>13} {'recompute/redis':>16}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['blob_bytes'] / 1e6:>8.1f} {r['recompute_s'] * 1e3:>13.1f} "
              f"{r['redis_hit_s'] * 1e3:>13.1f} {r['disk_cold_s'] * 1e3:>13.1f} "
              f"{r['disk_warm_s'] * 1e3:>13.1f} {r['recompute_over_redis']:>15.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
