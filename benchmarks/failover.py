"""Failures of a scaled-out deployment, on loopback: a shared Redis tier and two serve workers.

    python benchmarks/failover.py            # starts redis-server and two workers itself
    python benchmarks/failover.py --json

Three phases, each checked (the script exits 1 if a check fails):

1. Sharing. Chunks are ingested through worker A only; then the same texts are posted to worker
   B, whose store finds their blobs in Redis instead of encoding them (B's ingest time against
   A's), and B's first question over them reuses their tokens.
2. Redis restarts mid-run. Clients send greedy requests to both workers, each naming one chunk
   no worker has seen (`turborag_chunks`), so every request encodes a blob and writes it through
   to Redis; redis-server is killed after the second request ends and started again once three
   more have ended. No request may fail, and
   every answer must equal the answer the same request gets alone afterwards.
3. A worker is killed. Clients send requests round robin, as a load balancer would, and retry a
   request on the other worker when theirs is refused or cut off mid-stream; worker A gets
   kill -9 while streams are open. Worker B must serve every request it gets (zero errors), and
   every answer must equal its answer alone. Streams cut off by the kill are counted.

Needs redis-server on PATH (Debian: apt install redis-server) and the [server,redis] extras.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import chunk_texts, free_port, one_request, request_of  # noqa: E402


class Redis:
    """A redis-server on a loopback port that can be killed and started again on that port."""

    def __init__(self, port: int):
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                import redis
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except Exception:
                time.sleep(0.1)
        raise SystemExit("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def start_workers(n: int, redis_url: str, root: Path, model: str | None) -> list[tuple]:
    """n serve workers (started together: they load the model at the same time)."""
    workers = []
    for i in range(n):
        port = free_port()
        cmd = [sys.executable, "-m", "turborag_integrations.cli", "serve", "--port", str(port),
               "--kv-store", str(root / f"kv-{i}")]
        if model:
            cmd += ["--model", model]
        log = open(root / f"worker-{i}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "TURBORAG_REDIS_URL": redis_url})
        workers.append((proc, f"http://127.0.0.1:{port}", root / f"worker-{i}.log"))
    deadline = time.monotonic() + 900
    for proc, url, log in workers:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"a worker exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("a worker did not answer /health within 900 s")
            time.sleep(1)
    return workers


def fresh_chunk(i: int) -> str:
    """A chunk text no worker has seen before request i names it."""
    return (f"Addendum {i}: the tide gauge at pier {i} was recalibrated by the surveyor Halvard "
            f"Quist, who measured a drift of {3 * i + 7} millimetres over {i + 2} months. " * 3)


def request(client, url, model, i, texts, n_chunks, max_tokens, with_fresh: bool) -> dict:
    chunks, question = request_of(i, texts, n_chunks)
    if with_fresh:
        chunks = [*chunks, fresh_chunk(i)]
    return one_request(client, url, model, chunks, question, max_tokens,
                       extra={"turborag_chunks": [fresh_chunk(i)]} if with_fresh else None)


def drive(urls: list[str], model: str, ids: list[int], clients: int, texts: list[str],
          n_chunks: int, max_tokens: int, with_fresh: bool, failover: bool,
          results: list | None = None) -> list[dict]:
    """Send requests `ids` from `clients` threads, round robin over `urls`; with `failover`, a
    request refused or cut off on one worker is sent again to the next. `results` (appended to
    as requests end) lets another thread follow the progress."""
    results = [] if results is None else results
    lock, queue = threading.Lock(), list(ids)

    def loop() -> None:
        with httpx.Client(timeout=600) as client:
            while True:
                with lock:
                    if not queue:
                        return
                    i = queue.pop(0)
                out = {"id": i, "attempts": []}
                for attempt in range(len(urls) if failover else 1):
                    url = urls[(i + attempt) % len(urls)]
                    try:
                        res = request(client, url, model, i, texts, n_chunks, max_tokens,
                                      with_fresh)
                    except httpx.HTTPError as exc:
                        res = {"error": f"{type(exc).__name__}: {exc}"}
                    out["attempts"].append({"url": url, **{k: v for k, v in res.items()
                                                           if k in ("error", "reused")}})
                    if "error" not in res:
                        out.update(res, url=url)
                        break
                    out["error"] = res["error"]
                if "text" in out:
                    out.pop("error", None)
                with lock:
                    results.append(out)

    threads = [threading.Thread(target=loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(results, key=lambda r: r["id"])


def solo(url: str, model: str, ids: list[int], texts, n_chunks, max_tokens,
         with_fresh: bool) -> dict[int, str]:
    with httpx.Client(timeout=600) as client:
        return {i: request(client, url, model, i, texts, n_chunks, max_tokens, with_fresh)["text"]
                for i in ids}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24, help="requests in phases 2 and 3 each")
    ap.add_argument("--chunks", type=int, default=4, help="chunks per prompt (≈250 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not on PATH (Debian: apt install redis-server)")
    root = Path(tempfile.mkdtemp(prefix="turborag-failover-"))
    redis_server = Redis(free_port())
    redis_server.start()
    workers = start_workers(2, f"redis://127.0.0.1:{redis_server.port}/0", root, args.model)
    (proc_a, a, _), (proc_b, b, _) = workers
    report: dict = {"checks": {}}
    try:
        model = httpx.get(f"{a}/v1/models", timeout=30).json()["data"][0]["id"]
        texts = chunk_texts(max(args.chunks * 2, 8))

        # 1. A chunk ingested through A is a hit in B.
        t0 = time.perf_counter()
        httpx.post(f"{a}/v1/turborag/chunks", json={"texts": texts}, timeout=900).raise_for_status()
        ingest_a = time.perf_counter() - t0
        t0 = time.perf_counter()
        httpx.post(f"{b}/v1/turborag/chunks", json={"texts": texts}, timeout=900).raise_for_status()
        ingest_b = time.perf_counter() - t0
        with httpx.Client(timeout=600) as client:
            first_b = request(client, b, model, 0, texts, args.chunks, args.max_tokens, False)
        report["sharing"] = {"chunks": len(texts), "ingest_a_s": ingest_a, "ingest_b_s": ingest_b,
                             "first_query_on_b_reused_tokens": first_b.get("reused", 0)}
        report["checks"]["b_reuses_what_a_encoded"] = first_b.get("reused", 0) > 0

        # 2. Redis killed and restarted while requests write through to it.
        ids = list(range(args.requests))
        restarts = []

        progress: list[dict] = []
        during: list[int] = []

        def wait_for(count: int, limit_s: float) -> None:
            deadline = time.monotonic() + limit_s
            while len(progress) < count and time.monotonic() < deadline:
                time.sleep(0.2)

        def restart_redis() -> None:
            # Down from the 2nd finished request until 3 more have finished: requests are
            # admitted, encode their fresh chunk and write it through while Redis is gone.
            wait_for(2, 900)
            redis_server.kill()
            restarts.append(time.perf_counter())
            done_before = len(progress)
            wait_for(done_before + 3, 300)
            during.append(len(progress) - done_before)
            redis_server.start()
            restarts.append(time.perf_counter())

        chaos = threading.Thread(target=restart_redis)
        chaos.start()
        got = drive([a, b], model, ids, args.clients, texts, args.chunks, args.max_tokens,
                    with_fresh=True, failover=False, results=progress)
        chaos.join()
        reference = solo(b, model, ids, texts, args.chunks, args.max_tokens, with_fresh=True)
        errors = [r for r in got if "error" in r]
        report["redis_restart"] = {
            "requests": len(got), "errors": len(errors),
            "error_samples": [r["error"] for r in errors][:3],
            "mismatches": sum(r.get("text") != reference[r["id"]] for r in got if "text" in r),
            "redis_down_s": restarts[1] - restarts[0] if len(restarts) == 2 else None,
            "requests_finished_while_down": during[0] if during else 0}
        report["checks"]["redis_restart_no_failure"] = not errors
        report["checks"]["redis_restart_no_wrong_answer"] = report["redis_restart"]["mismatches"] == 0

        # 3. kill -9 of worker A while streams are open.
        ids = list(range(args.requests, 2 * args.requests))
        reference = solo(b, model, [i % 8 for i in ids], texts, args.chunks, args.max_tokens,
                         with_fresh=False)
        killed = []

        progress = []

        def kill_a() -> None:
            wait_for(2, 900)  # then streams are open on both workers
            time.sleep(1)
            os.kill(proc_a.pid, signal.SIGKILL)
            killed.append(time.perf_counter())

        chaos = threading.Thread(target=kill_a)
        chaos.start()
        got = drive([a, b], model, ids, args.clients, texts, args.chunks, args.max_tokens,
                    with_fresh=False, failover=True, results=progress)
        chaos.join()
        on_b = [x for r in got for x in r["attempts"] if x["url"] == b]
        cut = [x for r in got for x in r["attempts"] if x["url"] == a and "error" in x]
        report["worker_kill"] = {
            "requests": len(got), "failed": sum("error" in r for r in got),
            "attempts_on_b": len(on_b), "errors_on_b": sum("error" in x for x in on_b),
            "attempts_on_a_refused_or_cut": len(cut),
            "cut_samples": [x["error"] for x in cut][:3],
            "mismatches": sum(r.get("text") != reference[r["id"] % 8] for r in got if "text" in r)}
        w = report["worker_kill"]
        report["checks"]["b_keeps_serving"] = w["errors_on_b"] == 0 and w["failed"] == 0
        report["checks"]["no_wrong_answer_after_kill"] = w["mismatches"] == 0
    finally:
        for proc, _, _ in workers:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        redis_server.kill()
        shutil.rmtree(root, ignore_errors=True)
    report["model"] = model
    ok = all(report["checks"].values())
    if args.json:
        print(json.dumps(report))
    else:
        s, r, w = report["sharing"], report["redis_restart"], report["worker_kill"]
        print(f"1. sharing: {s['chunks']} chunks ingested through A in {s['ingest_a_s']:.1f} s, "
              f"the same texts through B in {s['ingest_b_s']:.1f} s (from Redis); B's first "
              f"question reused {s['first_query_on_b_reused_tokens']} tokens")
        print(f"2. redis-server killed for {r['redis_down_s'] or 0:.1f} s mid-run "
              f"({r['requests_finished_while_down']} requests finished meanwhile): "
              f"{r['requests']} requests, {r['errors']} failed, {r['mismatches']} answers "
              f"different from alone")
        print(f"3. worker A killed (-9) mid-run: {w['requests']} requests, {w['failed']} failed "
              f"after retry; B served {w['attempts_on_b']} attempts with {w['errors_on_b']} "
              f"errors; {w['attempts_on_a_refused_or_cut']} attempts on A refused or cut off; "
              f"{w['mismatches']} answers different from alone")
        print("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}"
                                     for k, v in report["checks"].items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
