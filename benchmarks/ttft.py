"""TTFT of a full prefill vs TurboRAG stitched from the on-disk KV store, side by side.

    python benchmarks/ttft.py                   # 8 × 512 and 16 × 512 tokens, median of 3 runs
    python benchmarks/ttft.py --chunks 8 --runs 5 --json
    python benchmarks/ttft.py --chunks 8 --recovery select:0.3   # also with another recovery

Each run times, on the same prompt and interleaved, after one warm-up of each: the full prefill,
TurboRAG as it runs by default (the engine's recovery, `select:0.15`: the probe that chooses the
tokens, then one forward over them and the question), the blobs stitched with no recovery, and
each --recovery. The TurboRAG column also gives its split: the selection pass and the forward.
The store's memory tier is off, so every TurboRAG run reads and verifies its blobs from disk
(the OS page cache stays warm, as it would on a serving machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.models import DEFAULT_MODEL
from turborag_integrations.core.store import KVStore
from turborag_integrations.core.prompt_template import render_chat

QUESTION = ("Considering every document above, which town's lighthouse can be seen from the "
            "farthest away, and who was the radio operator of the expedition?")
SAMPLE_DOCS = Path(__file__).resolve().parents[1] / "turborag_integrations" / "data" / "sample_docs"


def make_chunks(tokenizer, n: int, tokens: int) -> list[str]:
    """n distinct chunks of real prose, about `tokens` tokens each."""
    text = "\n\n".join(p.read_text() for p in sorted(SAMPLE_DOCS.glob("*.md")))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = []
    for i in range(n):
        # Number each chunk and rotate through the text so no two chunks are equal.
        start = (i * 197) % len(ids)
        window = (ids[start:] + ids)[: tokens - 8]
        chunks.append(f"[Document {i + 1}] " + tokenizer.decode(window).strip())
    return chunks


def measure(engine: TurboRAGEngine, n_chunks: int, chunk_tokens: int, runs: int,
            recoveries: list[str] = ()) -> dict:
    chunks = make_chunks(engine.tokenizer, n_chunks, chunk_tokens)
    engine.encode_chunks(chunks)
    messages = [{"role": "system", "content": "Answer using only the documents."},
                {"role": "user", "content": "Documents:\n\n" + "\n\n".join(chunks)
                 + f"\n\nQuestion: {QUESTION}"}]
    prompt = render_chat(engine.tokenizer, messages)
    one = GenerationConfig(max_new_tokens=1)
    full, turbo, bare, assembly, selection, forward = [], [], [], [], [], []
    recovered: dict[str, list[float]] = {spec: [] for spec in recoveries}
    for run in range(runs + 1):  # the first round is a warm-up
        f = engine.generate(prompt, config=one, mode="naive").stats
        t = engine.generate(prompt, chunks=chunks, config=one).stats
        if t.cache_hits != n_chunks:
            raise RuntimeError(f"only {t.cache_hits}/{n_chunks} chunks were reused")
        b = engine.generate(prompt, chunks=chunks, config=one, recovery="none").stats
        times = {spec: engine.generate(prompt, chunks=chunks, config=one,
                                       recovery=spec).stats.ttft_s for spec in recoveries}
        if run:
            full.append(f.ttft_s)
            turbo.append(t.ttft_s)
            bare.append(b.ttft_s)
            assembly.append(t.assembly_s)
            selection.append(t.extra["recovery_s"])
            forward.append(t.prefill_s)
            for spec, seconds in times.items():
                recovered[spec].append(seconds)
    full_s, turbo_s = statistics.median(full), statistics.median(turbo)
    bare_s = statistics.median(bare)
    return {"context_tokens": t.prompt_tokens, "reused_tokens": t.reused_tokens,
            "recovery": t.extra["recovery"], "recomputed_tokens": t.extra["recomputed_tokens"],
            "prefilled_tokens": t.prefilled_tokens, "full_s": full_s, "turbo_s": turbo_s,
            "selection_s": statistics.median(selection), "forward_s": statistics.median(forward),
            "assembly_s": statistics.median(assembly), "speedup": full_s / turbo_s,
            "stitched_s": bare_s, "stitched_speedup": full_s / bare_s, "runs": runs,
            "recoveries": {spec: {"turbo_s": statistics.median(ts),
                                  "speedup": full_s / statistics.median(ts)}
                           for spec, ts in recovered.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--chunks", type=int, nargs="+", default=[8, 16],
                    help="numbers of retrieved chunks to test (default 8 16)")
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3, help="timed runs after one warm-up (≥ 3)")
    ap.add_argument("--store", help="KV store folder (default: a temporary one)")
    ap.add_argument("--recovery", action="append", default=[], metavar="SPEC",
                    help="also time the stitched prompt with this query-time recovery, e.g. "
                         "first:32 (repeatable; docs/accuracy.md)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    from turborag_integrations.core.prefill.recovery import parse_recovery

    for spec in args.recovery:
        try:
            parse_recovery(spec)
        except ValueError as exc:
            ap.error(f"--recovery: {exc}")

    with tempfile.TemporaryDirectory() as tmp:
        engine = TurboRAGEngine(args.model, store=KVStore(args.store or tmp, memory_bytes=0),
                                progress=not args.json)
        results = []
        for n in args.chunks:
            # Leave room for the template and the question inside the model's window.
            per_chunk = min(args.chunk_tokens, (engine.context_window - 128) // n)
            results.append(measure(engine, n, per_chunk, args.runs, args.recovery))
            if not args.json:
                print(f"... {n} chunks done", file=sys.stderr)
    report = {"model": args.model, "dtype": engine.fingerprint.dtype, "results": results}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model {args.model} ({engine.fingerprint.dtype}), median of {args.runs} runs; "
          f"TurboRAG = the default recovery ({results[0]['recovery']}): selection + forward")
    print(f"{'context':>8} {'recomputed':>10} {'full prefill':>13} {'TurboRAG':>9} "
          f"{'selection':>10} {'forward':>8} {'speedup':>8} {'stitched alone':>15}"
          + "".join(f" {'+ ' + spec:>18}" for spec in args.recovery))
    for r in results:
        print(f"{r['context_tokens']:>8} {r['recomputed_tokens']:>10} {r['full_s']:>12.3f}s "
              f"{r['turbo_s']:>8.3f}s {r['selection_s']:>9.3f}s {r['forward_s']:>7.3f}s "
              f"{r['speedup']:>7.1f}x {r['stitched_s']:>7.3f}s {r['stitched_speedup']:>5.1f}x"
              + "".join(f" {r['recoveries'][spec]['turbo_s']:>8.3f}s "
                        f"{r['recoveries'][spec]['speedup']:>6.1f}x  " for spec in args.recovery))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
