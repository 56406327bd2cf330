"""TTFT and decode on cores shared with another busy process: OpenMP's barrier wait side by side.

    python benchmarks/shared_cores.py                 # 8 × 512-token chunks, median of 3 runs
    python benchmarks/shared_cores.py --chunks 4 --runs 5 --json

torch's CPU kernels run on OpenMP threads that, by default, spin at every barrier before they
sleep (libgomp: 300,000 iterations). A prefill of a few rows (the stitched prefill: the
question over a cache of blobs) or a decode step is mostly barriers, so when another process
holds a core, the spinning thread that waits for the descheduled one burns the time the work
needed. Each setting runs in its own process (OpenMP reads its environment once, when torch
loads):

- "spin": OpenMP's default (nothing set, torch loaded before the package);
- "package": the package's default: nothing set, the package imported first, which sets
  `GOMP_SPINCOUNT=1000` (core/environment.py `settle_openmp`);
- "passive": `OMP_WAIT_POLICY=PASSIVE` (threads sleep at once);
- "one thread": `OMP_NUM_THREADS=1`, no barrier at all.

each with the machine otherwise quiet and with one other process busy on one core (a Python
loop), measured in turn: the stitched prefill alone (`recovery="none"`), the default
(`select:0.15`), a full prefill, and decode tokens/s after the default prefill.

`--serve-clients 8` measures serving instead: a `turborag serve` worker per setting ("spin" is
`GOMP_SPINCOUNT=300000`, libgomp's own default, since the server imports the package before
torch), its chunks ingested and one request answered before the clock starts, then
`--serve-requests` streamed greedy chat completions from that many concurrent clients, each
decoding `--new-tokens` tokens (`ignore_eos`); the busy process runs only while they do.
Reported: the aggregate decode tokens/s, the median request's decode rate and TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from turborag_integrations.core.prompt_template import render_chat

HERE = Path(__file__).resolve().parent
SETTINGS = {"spin": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "package": {},
            "one thread": {"OMP_NUM_THREADS": "1"}}


def worker(setting: str, n_chunks: int, chunk_tokens: int, runs: int, new_tokens: int) -> dict:
    if setting == "spin":
        import torch  # noqa: F401  (loaded first: the package leaves OpenMP's default alone)
    sys.path.insert(0, str(HERE))
    import tempfile

    from ttft import QUESTION, make_chunks

    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.settings import GenerationConfig
    from turborag_integrations.core.store import KVStore

    with tempfile.TemporaryDirectory(prefix="turborag-cores-") as tmp:
        engine = TurboRAGEngine(store=KVStore(tmp, memory_bytes=0), progress=False)
        chunks = make_chunks(engine.tokenizer, n_chunks, chunk_tokens)
        engine.encode_chunks(chunks)
        prompt = render_chat(engine.tokenizer, [
            {"role": "system", "content": "Answer using only the documents."},
            {"role": "user", "content": "Documents:\n\n" + "\n\n".join(chunks)
             + f"\n\nQuestion: {QUESTION}"}])
        one = GenerationConfig(max_new_tokens=1)
        decode = GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
        times: dict[str, list[float]] = {"stitched": [], "default": [], "full": [], "decode": []}
        for run in range(runs + 1):  # the first round is a warm-up
            s = engine.generate(prompt, chunks=chunks, config=one, recovery="none").stats
            d = engine.generate(prompt, chunks=chunks, config=one).stats
            f = engine.generate(prompt, config=one, mode="naive").stats
            g = engine.generate(prompt, chunks=chunks, config=decode).stats
            if run:
                times["stitched"].append(s.ttft_s)
                times["default"].append(d.ttft_s)
                times["full"].append(f.ttft_s)
                times["decode"].append(g.decode_tokens_per_s)
        import torch
        return {"setting": setting, "threads": torch.get_num_threads(),
                "wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                "spincount": os.environ.get("GOMP_SPINCOUNT", ""),
                "prompt_tokens": d.prompt_tokens,
                **{f"{k}_median": statistics.median(v) for k, v in times.items()},
                "runs": times}


def run_setting(setting: str, busy: bool, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    env.update(SETTINGS[setting])
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        out = subprocess.run([sys.executable, __file__, "--worker", setting, "--chunks",
                              str(args.chunks), "--chunk-tokens", str(args.chunk_tokens),
                              "--runs", str(args.runs), "--new-tokens", str(args.new_tokens)],
                             env=env, capture_output=True, text=True, check=True)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "busy": busy}


SERVE_SETTINGS = {"spin": {"GOMP_SPINCOUNT": "300000"}, "package": {},
                  "one thread": {"OMP_NUM_THREADS": "1"}}


def serve_setting(setting: str, busy: bool, args) -> dict:
    """8 (or --serve-clients) concurrent clients against a `turborag serve` of this setting."""
    sys.path.insert(0, str(HERE))
    import httpx
    from load import chunk_texts, ingest, run, start_worker

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    env.update(SERVE_SETTINGS[setting])
    proc, url = start_worker(None, None, env=env)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        ingest([url], chunk_texts(max(args.serve_chunks * 2, 8)))
        extra = {"ignore_eos": True}
        run([url], model, 1, 1, 600, args.serve_chunks, args.new_tokens, None, extra)  # warm-up
        load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            out = run([url], model, args.serve_clients, args.serve_requests, 1200,
                      args.serve_chunks, args.new_tokens, None, extra)
        finally:
            if load is not None:
                load.kill()
                load.wait()
    finally:
        proc.terminate()
        proc.wait(30)
    if out["errors"]:
        raise SystemExit(f"{setting}: {out['errors']} requests failed: {out['error_samples']}")
    return {"setting": setting, "busy": busy, **out}


def serve_main(args) -> int:
    rows = [serve_setting(s, busy, args) for busy in (False, True) for s in SERVE_SETTINGS]
    for r in rows:  # against one thread under the same load
        ref = next(o for o in rows if o["busy"] == r["busy"] and o["setting"] == "one thread")
        r["decode_vs_one_thread"] = ref["decode_tokens_per_s"] / r["decode_tokens_per_s"]
    report = {"clients": args.serve_clients, "requests": args.serve_requests,
              "chunks": args.serve_chunks, "new_tokens": args.new_tokens,
              "cpus": os.cpu_count(), "serve": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"turborag serve, {args.serve_clients} clients, {args.serve_requests} requests of "
          f"{args.serve_chunks} chunks and {args.new_tokens} new tokens, {os.cpu_count()} CPUs; "
          "'vs 1 thr': time against one thread under the same load")
    print(f"{'load':>10} {'setting':>11} {'tok/s':>7} {'vs 1 thr':>9} {'TTFT p50':>9} "
          f"{'lat p50':>8}")
    for r in rows:
        print(f"{'busy core' if r['busy'] else 'quiet':>10} {r['setting']:>11} "
              f"{r['decode_tokens_per_s']:>7.1f} {r['decode_vs_one_thread']:>8.2f}x "
              f"{r['ttft_p50_s']:>8.2f}s {r['latency_p50_s']:>7.2f}s")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--serve-clients", type=int, default=0,
                    help="measure `turborag serve` with this many concurrent clients instead")
    ap.add_argument("--serve-requests", type=int, default=16)
    ap.add_argument("--serve-chunks", type=int, default=4, help="chunks (≈250 tokens) a request")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.chunks, args.chunk_tokens, args.runs, args.new_tokens) < 1:
        ap.error("--chunks, --chunk-tokens, --runs and --new-tokens must be at least 1")
    if args.worker:
        print(json.dumps(worker(args.worker, args.chunks, args.chunk_tokens, args.runs,
                                args.new_tokens)))
        return 0
    if args.serve_clients:
        return serve_main(args)
    rows = [run_setting(s, busy, args) for busy in (False, True) for s in SETTINGS]
    for r in rows:  # against one thread under the same load: the time no barrier wastes
        ref = next(o for o in rows if o["busy"] == r["busy"] and o["setting"] == "one thread")
        r["stitched_vs_one_thread"] = r["stitched_median"] / ref["stitched_median"]
        r["default_vs_one_thread"] = r["default_median"] / ref["default_median"]
        r["decode_vs_one_thread"] = ref["decode_median"] / r["decode_median"]
    report = {"chunks": args.chunks, "chunk_tokens": args.chunk_tokens, "runs": args.runs,
              "cpus": os.cpu_count(), "results": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.chunks} × {args.chunk_tokens}-token chunks ({rows[0]['prompt_tokens']} prompt "
          f"tokens), {os.cpu_count()} CPUs, median of {args.runs}; 'vs 1 thr': time against one "
          "thread under the same load")
    print(f"{'load':>10} {'setting':>11} {'thr':>4} {'stitched s':>11} {'vs 1 thr':>9} "
          f"{'default s':>10} {'vs 1 thr':>9} {'full s':>8} {'decode tok/s':>13} {'vs 1 thr':>9}")
    for r in rows:
        print(f"{'busy core' if r['busy'] else 'quiet':>10} {r['setting']:>11} {r['threads']:>4} "
              f"{r['stitched_median']:>11.3f} {r['stitched_vs_one_thread']:>8.2f}x "
              f"{r['default_median']:>10.3f} {r['default_vs_one_thread']:>8.2f}x "
              f"{r['full_median']:>8.2f} {r['decode_median']:>13.1f} "
              f"{r['decode_vs_one_thread']:>8.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
