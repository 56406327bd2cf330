"""Tenant isolation, measured: can tenant B tell which texts tenant A ingested?

    python benchmarks/tenants.py                           # turborag serve --keys
    python benchmarks/tenants.py --systems serve,vllm      # and vLLM with the connector
    python benchmarks/tenants.py --json

Texts: 2N chunk texts of the hand-written dev and held-out sets (deduplicated), shuffled with a
seed and split in two: tenant A ingests the first N, nobody ingests the other N. Tenant B then
asks one question over each of the 2N texts, alone in its prompt, in a random order (one client,
non-streamed, one new token: the time to that answer is its TTFT), and records the TurboRAG
figures of each answer. Reported, per system:

- B's probes: reused (claimed) tokens and cache hits over all 2N (isolation: 0), the TTFT medians
  of the two groups, and two-sample tests of them (Mann-Whitney U and Kolmogorov-Smirnov, scipy;
  p > 0.05: the groups cannot be told apart);
- A on its own chunks: --own prompts of 6 of its texts, each answered stitched and as a full
  prefill: the share of the prompt reused and the TTFT ratio (isolation costs nothing within a
  tenant).

`turborag serve` runs with a keys file of two tenants; vLLM (its own venv, `bash
scripts/install.sh vllm`) with the connector, A's blobs ingested by the HF engine into A's
namespace and the requests naming their tenant in `cache_salt` ("turborag:acme",
"turborag:globex"); its full prefills are requests without the salt (each with a salt of its own
that does not opt in, so vLLM's prefix cache gives none of them a head start).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import start_vllm, start_worker  # noqa: E402

MODEL = "smollm2-135m-instruct"
DATA = ROOT / "turborag_integrations" / "data"
QUESTION = "What is this passage about?"
OWN_CHUNKS = 6


def texts(n: int, seed: int) -> tuple[list[str], list[str]]:
    """(A's N texts, N texts nobody ingests), from the hand-written sets."""
    seen: dict[str, None] = {}
    for path in (DATA / "handdev" / "handdev.jsonl", DATA / "heldout" / "heldout.jsonl"):
        for line in path.read_text().splitlines():
            for chunk in json.loads(line)["chunks"]:
                if len(chunk) > 200:
                    seen[chunk.strip()] = None
    pool = list(seen)
    random.Random(seed).shuffle(pool)
    if len(pool) < 2 * n:
        raise SystemExit(f"only {len(pool)} distinct texts: ask for --texts {len(pool) // 2}")
    return pool[:n], pool[n:2 * n]


def chat(client: httpx.Client, url: str, chunks: list[str], extra: dict) -> dict:
    """One non-streamed greedy answer of one token: (seconds, TurboRAG figures)."""
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, **extra,
            "messages": [{"role": "system", "content": "Answer from the context."},
                         {"role": "user", "content": "Context:\n" + "\n\n".join(chunks)
                          + f"\n\nQuestion: {QUESTION}"}]}
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - t0
    if r.status_code != 200:
        raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    reply = r.json()
    stats = reply.get("turborag") or ((reply.get("kv_transfer_params") or {}).get("turborag")
                                      or {})
    reused = stats.get("reused_tokens", stats.get("claimed_tokens", 0))
    return {"ttft_s": elapsed, "reused": reused, "hits": stats.get("cache_hits", 0),
            "prompt_tokens": reply["usage"]["prompt_tokens"]}


def probe(url: str, auth: dict, a_texts: list[str], b_texts: list[str], seed: int,
          extra: dict) -> dict:
    """B asks over every text, in a random order; the two groups' figures."""
    order = [(t, "ingested_by_a") for t in a_texts] + [(t, "never_ingested") for t in b_texts]
    random.Random(seed + 1).shuffle(order)
    groups: dict[str, list[dict]] = {"ingested_by_a": [], "never_ingested": []}
    with httpx.Client(timeout=600, headers=auth) as client:
        chat(client, url, [b_texts[0]], extra)  # warm-up, not counted
        for text, group in order:
            groups[group].append(chat(client, url, [text], extra))
    return groups


def own(url: str, auth: dict, a_texts: list[str], n: int, turbo: dict, naive) -> dict:
    """A's prompts of OWN_CHUNKS of its texts, stitched and as a full prefill."""
    rows = []
    with httpx.Client(timeout=600, headers=auth) as client:
        for i in range(n):
            chunks = [a_texts[(i * OWN_CHUNKS + j) % len(a_texts)] for j in range(OWN_CHUNKS)]
            t = chat(client, url, chunks, turbo)
            f = chat(client, url, chunks, naive(i))
            rows.append({"turbo_s": t["ttft_s"], "naive_s": f["ttft_s"],
                         "reused_share": t["reused"] / t["prompt_tokens"]})
    return {"prompts": n,
            "reused_share_median": statistics.median(r["reused_share"] for r in rows),
            "ttft_turbo_median_s": statistics.median(r["turbo_s"] for r in rows),
            "ttft_naive_median_s": statistics.median(r["naive_s"] for r in rows),
            "ttft_ratio": (statistics.median(r["naive_s"] for r in rows)
                           / statistics.median(r["turbo_s"] for r in rows))}


def summary(groups: dict[str, list[dict]]) -> dict:
    from scipy import stats

    a = [r["ttft_s"] for r in groups["ingested_by_a"]]
    b = [r["ttft_s"] for r in groups["never_ingested"]]
    rows = groups["ingested_by_a"] + groups["never_ingested"]
    return {"probes": len(rows),
            "reused_tokens": sum(r["reused"] for r in rows),
            "cache_hits": sum(r["hits"] for r in rows),
            "ttft_median_ingested_by_a_s": statistics.median(a),
            "ttft_median_never_ingested_s": statistics.median(b),
            "mann_whitney_p": float(stats.mannwhitneyu(a, b, alternative="two-sided").pvalue),
            "ks_p": float(stats.ks_2samp(a, b).pvalue)}


def bench_serve(a_texts, b_texts, args) -> dict:
    from turborag_integrations.server.keys import KeyFile

    folder = Path(tempfile.mkdtemp(prefix="turborag-tenants-"))
    keys = KeyFile(folder / "keys.json", create=True)
    auth = {t: {"Authorization": f"Bearer {keys.add(t)[1]}"} for t in ("acme", "globex")}
    proc, url = start_worker(MODEL, str(folder / "kv"), "--keys", str(folder / "keys.json"))
    try:
        with httpx.Client(timeout=600, headers=auth["acme"]) as client:
            for i in range(0, len(a_texts), 50):
                r = client.post(f"{url}/v1/turborag/chunks", json={"texts": a_texts[i:i + 50]})
                if r.status_code != 200:
                    raise SystemExit(f"ingestion: HTTP {r.status_code}: {r.text[:300]}")
        groups = probe(url, auth["globex"], a_texts, b_texts, args.seed, {})
        mine = own(url, auth["acme"], a_texts, args.own, {},
                   lambda i: {"turborag_mode": "naive"})
    finally:
        proc.terminate()
        proc.wait(60)
    return {"probes": summary(groups), "own": mine}


def bench_vllm(a_texts, b_texts, args) -> dict:
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.models import prepare_bundled

    folder = Path(tempfile.mkdtemp(prefix="turborag-tenants-vllm-"))
    engine = TurboRAGEngine(MODEL, store=str(folder / "kv"), progress=False)
    engine.namespaced("acme").encode_chunks(a_texts)
    engine.close()
    python = args.python or ROOT / ".venv-vllm" / "bin" / "python"
    config = {"kv_connector": "TurboRAGConnector",
              "kv_connector_module_path": "turborag_integrations.vllm.connector",
              "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"store": str(folder / "kv"), "refresh_s": 0}}
    proc, url = start_vllm(python, str(prepare_bundled(MODEL, progress=False)), config)
    try:
        groups = probe(url, {}, a_texts, b_texts, args.seed, {"cache_salt": "turborag:globex"})
        mine = own(url, {}, a_texts, args.own, {"cache_salt": "turborag:acme"},
                   lambda i: {"cache_salt": f"plain-{i}"})
    finally:
        proc.terminate()
        proc.wait(120)
    return {"probes": summary(groups), "own": mine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=200, help="N: texts per group")
    parser.add_argument("--own", type=int, default=20, help="A's prompts on its own chunks")
    parser.add_argument("--systems", default="serve", help="serve and/or vllm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--python", type=Path, default=None,
                        help="python of vLLM's venv (default .venv-vllm/bin/python)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    a_texts, b_texts = texts(args.texts, args.seed)
    results = {"texts_per_group": args.texts}
    for system in args.systems.split(","):
        print(f"{system}…", file=sys.stderr, flush=True)
        results[system] = (bench_serve if system == "serve" else bench_vllm)(
            a_texts, b_texts, args)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print("| system | B's probes | reused tokens | cache hits | TTFT median, A's texts | "
          "TTFT median, never ingested | Mann-Whitney p | KS p | A: reused share | "
          "A: TTFT full / stitched |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for system in args.systems.split(","):
        p, o = results[system]["probes"], results[system]["own"]
        print(f"| {system} | {p['probes']} | {p['reused_tokens']} | {p['cache_hits']} | "
              f"{p['ttft_median_ingested_by_a_s'] * 1000:.1f} ms | "
              f"{p['ttft_median_never_ingested_s'] * 1000:.1f} ms | {p['mann_whitney_p']:.3f} | "
              f"{p['ks_p']:.3f} | {100 * o['reused_share_median']:.0f}% | "
              f"{o['ttft_ratio']:.1f}x |")


if __name__ == "__main__":
    main()
