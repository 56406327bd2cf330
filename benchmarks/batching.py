"""Batched decoding: one client at a time vs eight concurrent clients through `BatchScheduler`.

    python benchmarks/batching.py                     # 8 RAG prompts of ≈2K tokens, 64 new tokens
    python benchmarks/batching.py --runs 1 --json

Eight RAG prompts (sample documents + a question, chat template; each question over its own
stored chunks, built as in benchmarks/decode.py), each decoding --new-tokens tokens with
end-of-sequence suppressed (as in benchmarks/decode.py, so that every run does the same work):
- engine.generate: the eight prompts one after another, before any scheduler exists;
- 1 client: the eight requests one after another through one scheduler (batches of one);
- 8 clients: the eight requests at once through the same scheduler, each from its own thread.
The model is loaded, and the chunks encoded, on a thread that ends before the scheduler starts,
so that the scheduler's worker is the only thread with an OpenMP thread pool (see "Threads" in
docs/batching.md; --load-on-main measures the other case).

Decode tokens/s = the tokens after each request's first / the time spent decoding: the sum of
each request's first-to-last-token time when requests run one after another; the time from the
first first token to the last token for 8 clients (the prefills of the requests admitted
meanwhile count against it). End-to-end tokens/s = all new tokens / the time from the first
call to the last token. TTFT runs from a client's call to its first token: under the 8-client
load it includes the wait for the prefills admitted before it. Greedy answers of both scheduler
modes are compared with engine.generate's. Medians over --runs runs, after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import QUESTIONS, rag_prompt  # noqa: E402

from turborag_integrations.core.batching import BatchScheduler, on_own_thread  # noqa: E402
from turborag_integrations.core.engine import TurboRAGEngine  # noqa: E402
from turborag_integrations.core.models import DEFAULT_MODEL  # noqa: E402
from turborag_integrations.core.settings import GenerationConfig  # noqa: E402
from turborag_integrations.core.store import KVStore  # noqa: E402


def one_request(scheduler: BatchScheduler, prompt: str, chunks: list[str],
                config: GenerationConfig) -> dict:
    t0 = time.perf_counter()
    stream = scheduler.submit(prompt, chunks=chunks, config=config)
    for _ in stream:
        pass
    stats = stream.result.stats
    if stats.cache_hits != len(chunks):
        raise RuntimeError(f"only {stats.cache_hits}/{len(chunks)} chunks were reused")
    first = t0 + stats.ttft_s
    return {"start": t0, "first": first, "last": first + stats.decode_s,
            "tokens": stream.result.token_ids, "ttft_s": stats.ttft_s,
            "batch": stats.extra.get("mean_batch_size", 1.0)}


def clients(scheduler: BatchScheduler, prompts, config: GenerationConfig,
            concurrent: bool) -> list[dict]:
    if not concurrent:
        return [one_request(scheduler, p, c, config) for p, c in prompts]
    out: list[dict | None] = [None] * len(prompts)
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            out[i] = one_request(scheduler, *prompts[i], config)
        except BaseException as exc:  # reported after the join
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out  # type: ignore[return-value]


def summary(requests: list[dict], concurrent: bool) -> dict:
    decoded = sum(len(r["tokens"]) - 1 for r in requests)
    if concurrent:  # from the first first token to the last token
        window = max(r["last"] for r in requests) - min(r["first"] for r in requests)
    else:  # one after another: each request's own first to last token
        window = sum(r["last"] - r["first"] for r in requests)
    total = max(r["last"] for r in requests) - min(r["start"] for r in requests)
    return {"decode_tps": decoded / window,
            "end_to_end_tps": sum(len(r["tokens"]) for r in requests) / total,
            "ttft_s": [r["ttft_s"] for r in requests],
            "mean_batch_size": statistics.mean(r["batch"] for r in requests)}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def prepare(args, tmp: str) -> dict:
    """The engine, the prompts (their chunks encoded and stored) and `engine.generate`'s answers
    and decode speed, each prompt alone."""
    engine = TurboRAGEngine(args.model, store=KVStore(tmp, memory_bytes=0), progress=False)
    engine.warmup()
    prompts = [rag_prompt(engine, args.context, QUESTIONS[i % len(QUESTIONS)], offset=331 * i)
               for i in range(args.clients)]
    engine.eos_ids = set()  # every request decodes --new-tokens tokens
    config = GenerationConfig(max_new_tokens=args.new_tokens)
    tps = []
    for run in range(args.runs + 1):  # the first round is a warm-up
        results = [engine.generate(p, chunks=c, config=config) for p, c in prompts]
        if run:
            tps.append(sum(r.stats.new_tokens - 1 for r in results)
                       / sum(r.stats.decode_s for r in results))
    return {"engine": engine, "prompts": prompts, "generate_tps": statistics.median(tps),
            "generate_answers": [r.token_ids for r in results],
            "context_tokens": results[0].stats.prompt_tokens}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--context", type=int, default=2048, help="approximate prompt tokens")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per request")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median), after one warm-up")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--load-on-main", action="store_true",
                    help="load the model and encode the chunks on the main thread, which then "
                         "keeps an OpenMP thread pool next to the scheduler's (slower; see "
                         "docs/batching.md)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))

    with tempfile.TemporaryDirectory() as tmp:
        setup = prepare(args, tmp) if args.load_on_main else on_own_thread(lambda: prepare(args, tmp))
        engine, prompts = setup["engine"], setup["prompts"]
        say(f"  engine.generate alone: {setup['generate_tps']:.1f} tok/s")
        config = GenerationConfig(max_new_tokens=args.new_tokens)
        rows: dict[str, list[dict]] = {"1": [], "n": []}
        answers: dict[str, list] = {}
        with BatchScheduler(engine, max_batch=args.clients) as scheduler:
            for run in range(args.runs + 1):  # the first round is a warm-up
                for key, concurrent in (("1", False), ("n", True)):
                    requests = clients(scheduler, prompts, config, concurrent)
                    answers[key] = [r["tokens"] for r in requests]
                    if run:
                        rows[key].append(summary(requests, concurrent))
                if run:
                    say(f"  run {run}: 1 client {rows['1'][-1]['decode_tps']:.1f} tok/s, "
                        f"{args.clients} clients {rows['n'][-1]['decode_tps']:.1f} tok/s "
                        f"(mean batch {rows['n'][-1]['mean_batch_size']:.1f})")

    med = statistics.median
    one, many = rows["1"], rows["n"]
    ttft_n = [t for r in many for t in r["ttft_s"]]
    ttft_1 = [t for r in one for t in r["ttft_s"]]
    solo = setup["generate_answers"]
    report = {
        "model": args.model, "threads": torch.get_num_threads(), "clients": args.clients,
        "context_tokens": setup["context_tokens"], "new_tokens": args.new_tokens,
        "runs": args.runs, "loaded_on_main_thread": args.load_on_main,
        "generate_decode_tps": setup["generate_tps"],
        "one_client_decode_tps": med(r["decode_tps"] for r in one),
        "many_clients_decode_tps": med(r["decode_tps"] for r in many),
        "one_client_end_to_end_tps": med(r["end_to_end_tps"] for r in one),
        "many_clients_end_to_end_tps": med(r["end_to_end_tps"] for r in many),
        "many_clients_mean_batch_size": med(r["mean_batch_size"] for r in many),
        "one_client_ttft_p50_s": percentile(ttft_1, 50),
        "one_client_ttft_p95_s": percentile(ttft_1, 95),
        "many_clients_ttft_p50_s": percentile(ttft_n, 50),
        "many_clients_ttft_p95_s": percentile(ttft_n, 95),
        "one_client_answers_equal_generate": sum(a == b for a, b in zip(answers["1"], solo)),
        "many_clients_answers_equal_generate": sum(a == b for a, b in zip(answers["n"], solo)),
    }
    report["speedup"] = report["many_clients_decode_tps"] / report["one_client_decode_tps"]
    if args.json:
        print(json.dumps(report))
        return 0
    n, r = args.clients, report
    lines = [f"model {args.model}, {r['threads']} threads, {n} prompts of "
             f"≈{r['context_tokens']} tokens, {args.new_tokens} new tokens each, median of "
             f"{args.runs} runs",
             f"{'':>20} {'engine.generate':>16} {'1 client':>9} {f'{n} clients':>10}"]
    table = [  # name, engine.generate, 1 client, n clients, format
        ("decode tokens/s", r["generate_decode_tps"], r["one_client_decode_tps"],
         r["many_clients_decode_tps"], ".1f"),
        ("end-to-end tokens/s", None, r["one_client_end_to_end_tps"],
         r["many_clients_end_to_end_tps"], ".1f"),
        ("TTFT p50 (s)", None, r["one_client_ttft_p50_s"], r["many_clients_ttft_p50_s"], ".3f"),
        ("TTFT p95 (s)", None, r["one_client_ttft_p95_s"], r["many_clients_ttft_p95_s"], ".3f"),
        ("mean batch size", None, 1, r["many_clients_mean_batch_size"], ".1f"),
    ]
    for name, *values, fmt in table:
        cells = ["" if v is None else format(v, fmt) for v in values]
        lines.append(f"{name:>20} {cells[0]:>16} {cells[1]:>9} {cells[2]:>10}")
    lines.append(f"{n} clients: {r['speedup']:.1f}x the decode tokens/s of 1 client; greedy "
                 f"answers equal to engine.generate's: 1 client "
                 f"{r['one_client_answers_equal_generate']}/{n}, {n} clients "
                 f"{r['many_clients_answers_equal_generate']}/{n}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
