"""Load test of `turborag serve`: RAG chat completions from concurrent clients, on loopback.

    python benchmarks/load.py                                  # starts one worker itself
    python benchmarks/load.py --url http://127.0.0.1:8001 --url http://127.0.0.1:8002

Each client sends streaming chat completions whose user turn holds `--chunks` stored chunks and a
question, round robin over the workers, until `--requests` requests are done or `--duration`
seconds have passed (whichever comes first: the test is bounded either way). The chunks are
ingested first through `/v1/turborag/chunks` on every worker (a worker that shares a KV tier
finds them already encoded). Prints requests/s, aggregate decode tokens/s, and p50/p95 of the
time to the first content token and of the whole request; `--json` prints one JSON object.
Loopback only: a URL that is not 127.0.0.1/localhost/[::1] is refused. Greedy decoding; with
`--check`, each distinct prompt is first answered alone, and every answer under load must equal
it (the count of those that differ is reported as `mismatches`). The bundled model ends these
answers after a few tokens; `--ignore-eos` makes each run to `--max-tokens`, so that the check
compares every token a request may decode.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parents[1]

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
TOPICS = ["lighthouse", "ferry", "kiln", "furnace", "glacier", "harbour", "orchard", "library"]


def chunk_texts(n: int) -> list[str]:
    """n distinct paragraphs of about 250 tokens each."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        sentences = [f"Record {i}.{j}: the {topic} of district {i} logged {17 * i + j} visitors "
                     f"on day {j}, and its keeper noted the weather as {'calm' if j % 2 else 'windy'}."
                     for j in range(12)]
        out.append(" ".join(sentences))
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(model: str | None, store: str | None, *options: str,
                 env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """A `turborag serve` worker on a free loopback port (more serve `options` appended; `env`:
    its environment instead of this one's), once it answers /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "turborag_integrations.cli", "serve", "--port", str(port),
           *options]
    if model:
        cmd += ["--model", model]
    if store:
        cmd += ["--kv-store", store]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 600, "the worker", lambda: proc.stderr.read()[-2000:])
    return proc, url


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str,
                 output) -> None:
    """Return once `url`/health answers 200; exit with `output()` if the process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited:\n{output()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise SystemExit(f"{what} did not answer /health within {timeout:.0f} s")


def start_vllm(python: Path, model_dir: str, config: dict | None, dtype: str = "float32",
               model: str = "smollm2-135m-instruct") -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server (`config`: the TurboRAG connector's kv-transfer config; None: vLLM
    alone) on a free loopback port, once it answers /health; served as `model`."""
    from turborag_integrations.vllm.launch import cpu_environment, server_argv

    port = free_port()
    extra = ["--max-model-len", "4096", "--max-num-seqs", "8", "--disable-log-stats"]
    argv = server_argv(python, model_dir, config or {}, host="127.0.0.1", port=port,
                       dtype=dtype, served_model_name=model, extra=extra)
    if config is None:  # vLLM alone: no connector
        i = argv.index("--kv-transfer-config")
        del argv[i:i + 2]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**cpu_environment(), "HF_HUB_OFFLINE": "1",
                                 "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(proc, url, 900, "vLLM", lambda: Path(log.name).read_text()[-3000:])
    return proc, url


def one_request(client: httpx.Client, url: str, model: str, chunks: list[str], question: str,
                max_tokens: int, extra: dict | None = None) -> dict:
    """One streamed greedy chat completion; `extra`: more body fields."""
    body = {**(extra or {}), "model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": "Answer from the context."},
                         {"role": "user", "content": "\n\n".join(chunks) + "\n\n" + question}]}
    t0 = time.perf_counter()
    first, tokens, stats, text = None, 0, {}, ""
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {response.read()[:300]!r}"}
        done = False
        for line in response.iter_lines():
            done = done or line == "data: [DONE]"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            delta = event["choices"][0].get("delta", {}).get("content") if event.get("choices") else None
            if delta:
                first = first or time.perf_counter()
                text += delta
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens", tokens)
            stats = event.get("turborag") or stats
    end = time.perf_counter()
    if not done:
        return {"error": f"the stream ended without [DONE] after {len(text)} characters"}
    return {"text": text, "ttft_s": (first or end) - t0, "latency_s": end - t0, "tokens": tokens,
            "decode_s": end - (first or end), "reused": stats.get("reused_tokens", 0)}


def request_of(i: int, texts: list[str], n_chunks: int) -> tuple[list[str], str]:
    """The chunks and question of request i (8 distinct prompts, repeating)."""
    i %= len(TOPICS)
    start = (i * n_chunks) % len(texts)
    chunks = [texts[(start + j) % len(texts)] for j in range(n_chunks)]
    return chunks, f"How many visitors did the {TOPICS[i]} log on day 3?"


def run(urls: list[str], model: str, clients: int, requests: int, duration: float,
        n_chunks: int, max_tokens: int, reference: dict[int, str] | None = None,
        extra: dict | None = None) -> dict:
    texts = chunk_texts(max(n_chunks * 2, 8))
    results: list[dict] = []
    lock = threading.Lock()
    issued = [0]
    stop_at = time.monotonic() + duration

    def client_loop(c: int) -> None:
        with httpx.Client(timeout=600) as client:
            while time.monotonic() < stop_at:
                with lock:
                    if issued[0] >= requests:
                        return
                    i = issued[0]
                    issued[0] += 1
                chunks, question = request_of(i, texts, n_chunks)
                try:
                    res = one_request(client, urls[i % len(urls)], model, chunks, question,
                                      max_tokens, extra)
                except httpx.HTTPError as exc:
                    res = {"error": repr(exc)}
                res["prompt"] = i % len(TOPICS)
                with lock:
                    results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client_loop, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    return {"workers": len(urls), "clients": clients, "requests": len(results),
            "errors": len(results) - len(ok), "error_samples": [r["error"] for r in results
                                                                 if "error" in r][:3],
            "wall_s": wall, "requests_per_s": len(ok) / wall if wall else 0.0,
            "decode_tokens_per_s": sum(r["tokens"] for r in ok) / wall if wall else 0.0,
            "completion_tokens_mean": statistics.mean([r["tokens"] for r in ok]) if ok else 0,
            "ttft_p50_s": percentile([r["ttft_s"] for r in ok], 0.5),
            "ttft_p95_s": percentile([r["ttft_s"] for r in ok], 0.95),
            "latency_p50_s": percentile([r["latency_s"] for r in ok], 0.5),
            "latency_p95_s": percentile([r["latency_s"] for r in ok], 0.95),
            "reused_tokens_median": statistics.median([r["reused"] for r in ok]) if ok else 0,
            "mismatches": (sum(r["text"] != reference[r["prompt"]] for r in ok)
                           if reference is not None else None)}


def ingest(urls: list[str], texts: list[str]) -> None:
    for url in urls:
        r = httpx.post(f"{url}/v1/turborag/chunks", json={"texts": texts}, timeout=600)
        r.raise_for_status()


def solo_answers(urls: list[str], model: str, n_chunks: int, max_tokens: int,
                 extra: dict | None = None) -> dict[int, str]:
    """Each distinct prompt answered alone, by the first worker."""
    texts = chunk_texts(max(n_chunks * 2, 8))
    with httpx.Client(timeout=600) as client:
        return {i: one_request(client, urls[0], model, *request_of(i, texts, n_chunks),
                               max_tokens, extra)["text"] for i in range(len(TOPICS))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", action="append", default=[],
                    help="a running worker (repeatable); none: start one here")
    ap.add_argument("--model", default=None, help="model of the worker started here")
    ap.add_argument("--store", default=None, help="KV store of the worker started here")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8],
                    help="concurrent clients, one run per value (default 1 8)")
    ap.add_argument("--requests", type=int, default=16, help="requests per run (default 16)")
    ap.add_argument("--duration", type=float, default=600, help="seconds per run at most")
    ap.add_argument("--chunks", type=int, default=4, help="chunks per prompt (≈250 tokens each)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every answer runs to --max-tokens (the server's ignore_eos), so that "
                    "--check compares that many tokens per request")
    ap.add_argument("--check", action="store_true",
                    help="compare every answer with the prompt's answer alone")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    for url in args.url:
        if urlparse(url).hostname not in LOOPBACK:
            ap.error(f"{url} is not a loopback address: this load test only targets loopback")
    proc = None
    urls = args.url
    if not urls:
        proc, url = start_worker(args.model, args.store)
        urls = [url]
    try:
        model = httpx.get(f"{urls[0]}/v1/models", timeout=30).json()["data"][0]["id"]
        ingest(urls, chunk_texts(max(args.chunks * 2, 8)))
        extra = {"ignore_eos": True} if args.ignore_eos else None
        reference = (solo_answers(urls, model, args.chunks, args.max_tokens, extra)
                     if args.check else None)
        runs = [run(urls, model, c, args.requests, args.duration, args.chunks, args.max_tokens,
                    reference, extra) for c in args.clients]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    out = {"model": model, "max_tokens": args.max_tokens, "chunks": args.chunks,
           "ignore_eos": args.ignore_eos, "runs": runs}
    if len(runs) > 1 and runs[0]["decode_tokens_per_s"]:
        out["aggregate_speedup"] = runs[-1]["decode_tokens_per_s"] / runs[0]["decode_tokens_per_s"]
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'clients':>7} {'req':>4} {'err':>4} {'diff':>4} {'req/s':>6} {'tok/s':>7} "
          f"{'TTFT p50':>9} {'TTFT p95':>9} {'lat p50':>8} {'lat p95':>8}")
    for r in runs:
        diff = "-" if r["mismatches"] is None else r["mismatches"]
        print(f"{r['clients']:>7} {r['requests']:>4} {r['errors']:>4} {diff:>4} "
              f"{r['requests_per_s']:>6.2f} "
              f"{r['decode_tokens_per_s']:>7.1f} {r['ttft_p50_s']:>8.2f}s {r['ttft_p95_s']:>8.2f}s "
              f"{r['latency_p50_s']:>7.2f}s {r['latency_p95_s']:>7.2f}s")
    if "aggregate_speedup" in out:
        print(f"aggregate decode tokens/s, {runs[-1]['clients']} clients vs {runs[0]['clients']}: "
              f"{out['aggregate_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
