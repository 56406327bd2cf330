"""vLLM alone vs vLLM + TurboRAG's connector vs `turborag serve`, side by side in one run.

    bash scripts/install.sh vllm                  # vLLM's own venv, once
    python benchmarks/vllm.py                     # 8 RAG prompts of ≈2.1K tokens, 64 new tokens
    python benchmarks/vllm.py --runs 1 --json

Eight chat prompts (system line, then 4 chunks of ≈500 tokens of the sample documents joined by
"\\n\\n", then a question), each answered with 64 new tokens (greedy, end-of-sequence ignored, so
every system does the same work), through the OpenAI chat API with streaming, by:
- vLLM alone (`--enforce-eager`, float32, every core bound);
- vLLM with the TurboRAG connector over a store the HF engine filled (chunks, the prompt head
  and the stock separators; the bundled chunk encoder), requests opting in with `cache_salt`;
- `turborag serve --mode turbo` over the same store, and `--mode naive` for the answers vLLM
  alone should give.
The servers run one after another (two cores cannot host two), each warmed up with one request.
With 1 client the eight requests go one after another; with 8 clients all at once. TTFT runs
from a client's call to its first streamed token; wall time from the first call to the last
token; decode tokens/s = tokens after each request's first / the time spent decoding (1 client:
the sum of first-to-last times; 8 clients: the first first token to the last token). Each run
uses its own cache_salt, so no run reuses vLLM's prefix cache of the one before. Medians over
--runs runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import QUESTIONS, make_chunks  # noqa: E402
from load import one_request, percentile, start_vllm, start_worker  # noqa: E402
from turborag_integrations.core.prompt_template import render_chat

MODEL = "smollm2-135m-instruct"
SYSTEM = "Answer from the context."  # load.one_request's system message


JOINS = {"blank-line": "\n\n", "newline": ""}


def build_prompts(engine, n_prompts: int, n_chunks: int, chunk_tokens: int, join: str):
    """(chunks, question) each; with --join newline every chunk ends its own line and chunks
    follow each other with nothing between (no separator to stitch)."""
    prompts = []
    for i in range(n_prompts):
        chunks = make_chunks(engine.tokenizer, n_chunks, chunk_tokens, offset=i * 1009)
        if join == "newline":
            chunks = [c + "\n" for c in chunks]
        prompts.append((chunks, QUESTIONS[i % len(QUESTIONS)]))
    return prompts


def context(chunks: list[str], join: str) -> list[str]:
    """The context as load.one_request's one "chunk" (it joins its chunks with a blank line)."""
    return [JOINS[join].join(chunks)]


def fill_store(engine, prompts, join: str) -> int:
    """Chunks, separators and the chat head every prompt starts with; returns prompt tokens."""
    for chunks, _ in prompts:
        engine.encode_chunks(chunks)
    chunks, question = prompts[0]
    rendered = render_chat(engine.tokenizer, [{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": context(chunks, join)[0]
                                    + "\n\n" + question}])
    engine.library.prefix_blob(rendered[:rendered.index(chunks[0])])
    return len(engine.tokenizer(rendered, add_special_tokens=False)["input_ids"])


def claimed_tokens(url: str, prompt, salt: str, join: str) -> int | None:
    """Prompt tokens the connector supplied, from a non-streamed request's kv_transfer_params."""
    chunks, question = prompt
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "cache_salt": salt,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": context(chunks, join)[0] + "\n\n"
                          + question}]}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
    params = reply.get("kv_transfer_params") or {}
    return (params.get("turborag") or {}).get("claimed_tokens")


def measure(url: str, prompts, clients: int, new_tokens: int, extra: dict, join: str) -> dict:
    results: list[dict | None] = [None] * len(prompts)

    def one(i: int, client: httpx.Client) -> None:
        t0 = time.perf_counter()
        chunks, question = prompts[i]
        r = one_request(client, url, MODEL, context(chunks, join), question, new_tokens, extra)
        if "error" in r:
            raise SystemExit(f"{url}: {r['error']}")
        r["start"], r["first"] = t0, t0 + r["ttft_s"]
        r["last"] = t0 + r["latency_s"]
        results[i] = r

    with httpx.Client(timeout=900) as client:
        if clients == 1:
            for i in range(len(prompts)):
                one(i, client)
        else:
            threads = [threading.Thread(target=one, args=(i, client)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    done = [r for r in results if r is not None]
    tokens_after_first = sum(max(0, r["tokens"] - 1) for r in done)
    if clients == 1:
        decode_s = sum(r["last"] - r["first"] for r in done)
    else:
        decode_s = max(r["last"] for r in done) - min(r["first"] for r in done)
    ttfts = [r["ttft_s"] for r in done]
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": percentile(ttfts, 95),
            "wall_s": max(r["last"] for r in done) - min(r["start"] for r in done),
            "decode_tok_s": tokens_after_first / decode_s if decode_s > 0 else 0.0,
            "texts": [r["text"] for r in done], "tokens": [r["tokens"] for r in done]}


def median_of(runs: list[dict]) -> dict:
    keys = ("ttft_p50_s", "ttft_p95_s", "wall_s", "decode_tok_s")
    return {**{k: statistics.median(r[k] for r in runs) for k in keys},
            "texts": runs[0]["texts"], "tokens": runs[0]["tokens"]}


def bench_system(name: str, url: str, prompts, args, salt_prefix: str | None) -> dict:
    out = {}
    warm = {"ignore_eos": True}
    if salt_prefix:
        warm["cache_salt"] = f"{salt_prefix}-warmup"
    chunks, question = prompts[0]
    one_request(httpx.Client(timeout=900), url, MODEL, context(chunks, args.join), question, 4,
                warm)
    for clients in args.clients:
        runs = []
        for r in range(args.runs):
            extra = {"ignore_eos": True}
            if salt_prefix:
                extra["cache_salt"] = f"{salt_prefix}-c{clients}-r{r}"
            runs.append(measure(url, prompts, clients, args.new_tokens, extra, args.join))
        out[clients] = median_of(runs)
        print(f"  {name}, {clients} client(s): TTFT p50 {out[clients]['ttft_p50_s']:.2f} s",
              file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=500)
    parser.add_argument("--python", type=Path, default=None,
                        help="python of vLLM's venv (default .venv-vllm/bin/python)")
    parser.add_argument("--join", choices=sorted(JOINS), default="blank-line",
                        help="blank-line: chunks joined by \"\\n\\n\" as LlamaIndex joins nodes "
                        "(vLLM stitches the separator); newline: each chunk ends its line, "
                        "nothing between chunks")
    parser.add_argument("--systems", default="vllm,vllm+turborag,turbo,naive",
                        help="which of vllm, vllm+turborag, turbo, naive (turborag serve) to run")
    parser.add_argument("--dtype", default="float32",
                        help="vLLM's dtype; the blobs are always encoded in float32 (the "
                        "connector casts them: its blob_dtype)")
    parser.add_argument("--answers", type=Path, default=None,
                        help="also write every system's 1-client answers to this JSON file")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.clients = [int(c) for c in args.clients.split(",")]
    wanted = set(args.systems.split(","))

    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.bundled import prepare_bundled
    from turborag_integrations.vllm.launch import kv_transfer_config

    python = args.python or Path(os.environ.get("TURBORAG_VLLM_PYTHON",
                                                ROOT / ".venv-vllm" / "bin" / "python"))
    if not python.exists():
        raise SystemExit(f"no vLLM venv at {python}: bash scripts/install.sh vllm")
    model_dir = str(prepare_bundled(MODEL, progress=False))
    store = tempfile.mkdtemp(prefix="turborag-bench-vllm-")
    engine = TurboRAGEngine(MODEL, store=store, progress=False)
    prompts = build_prompts(engine, 8, args.chunks, args.chunk_tokens, args.join)
    prompt_tokens = fill_store(engine, prompts, args.join)
    texts = [c for chunks, _ in prompts for c in chunks]
    engine.close()
    del engine

    systems: dict[str, dict] = {}
    claimed = None
    for name, config in (("vllm", None),
                         ("vllm+turborag", kv_transfer_config(store, encoder=MODEL,
                                                              blob_dtype="float32"))):
        if name not in wanted:
            continue
        print(f"starting {name}", file=sys.stderr, flush=True)
        proc, url = start_vllm(python, model_dir, config, args.dtype)
        try:
            salt = "turborag" if config else "plain"
            systems[name] = bench_system(name, url, prompts, args, salt)
            if config:
                claimed = claimed_tokens(url, prompts[0], "turborag-claim", args.join)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    for mode in ("turbo", "naive"):
        if mode not in wanted:
            continue
        name = f"turborag serve {mode}"
        print(f"starting {name}", file=sys.stderr, flush=True)
        proc, url = start_worker(MODEL, store, "--mode", mode)
        try:
            if mode == "turbo":
                httpx.post(f"{url}/v1/turborag/chunks", json={"texts": texts}, timeout=900)
            clients = args.clients if mode == "turbo" else [1]
            saved, args.clients = args.clients, clients
            systems[name] = bench_system(name, url, prompts, args, None)
            args.clients = saved
        finally:
            proc.terminate()
            proc.wait(timeout=60)

    def equal(a: str, b: str, clients: int = 1) -> int | None:
        if a not in systems or b not in systems:
            return None
        return sum(x == y for x, y in zip(systems[a][clients]["texts"],
                                          systems[b][clients]["texts"]))

    base = systems.get("vllm", {})
    report = {
        "prompt_tokens": prompt_tokens, "new_tokens": args.new_tokens, "runs": args.runs,
        "join": args.join, "vllm_dtype": args.dtype,
        "claimed_tokens_of_prompt_0": claimed,
        "systems": {name: {str(c): {k: v for k, v in m.items() if k not in ("texts", "tokens")}
                           for c, m in s.items()} for name, s in systems.items()},
        "answers_equal": {
            "vllm vs turborag serve naive": equal("vllm", "turborag serve naive"),
            "vllm+turborag vs turborag serve turbo": equal("vllm+turborag", "turborag serve turbo"),
        },
        "ratios_vs_vllm_alone": {
            name: {str(c): {"ttft_p50": base[c]["ttft_p50_s"] / s[c]["ttft_p50_s"],
                            "wall": base[c]["wall_s"] / s[c]["wall_s"]}
                   for c in s if c in base}
            for name, s in systems.items() if name != "vllm"},
    }
    if args.answers:
        args.answers.write_text(json.dumps(
            {name: s[1]["texts"] for name, s in systems.items() if 1 in s}, indent=1))
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{prompt_tokens}-token prompts, {args.new_tokens} new tokens, medians of {args.runs} "
          f"runs; vLLM+TurboRAG claimed {claimed} prompt tokens of prompt 0 from the store\n")
    print("| system | clients | TTFT p50 s | TTFT p95 s | wall s (8 answers) | decode tok/s | "
          "TTFT p50 vs vLLM | wall vs vLLM |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in systems.items():
        for c, m in s.items():
            r = report["ratios_vs_vllm_alone"].get(name, {}).get(str(c))
            if r:
                ratio = f"{r['ttft_p50']:.1f}x | {r['wall']:.1f}x"
            else:
                ratio = "1.0x | 1.0x" if name == "vllm" else "— | —"
            print(f"| {name} | {c} | {m['ttft_p50_s']:.2f} | {m['ttft_p95_s']:.2f} | "
                  f"{m['wall_s']:.1f} | {m['decode_tok_s']:.1f} | {ratio} |")
    print()
    for k, v in report["answers_equal"].items():
        if v is not None:
            print(f"answers equal, {k}: {v}/8")


if __name__ == "__main__":
    main()
