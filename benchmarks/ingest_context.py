"""What context encoding costs at ingestion: chunk encoding time with context_tokens 0, 256, 1024.

    python benchmarks/ingest_context.py                          # bundled SmolLM2, 12 dev items
    python benchmarks/ingest_context.py --model qwen2.5-coder-0.5b-instruct --limit 6 --json

Each item of a JSONL set (default: the hand-written dev set) is one document whose chunks are its
sections in order; every chunk is encoded after the end of its document's text before it
(core/prefill/context.py), as the vector stores and `turborag ingest` do. The settings are timed
in turn, `--repeats` rounds, on one loaded model (encoding only: no store writes); the table gives
the median seconds per round, the tokens prefilled (chunk and context) and the ratio to
context_tokens 0. Query time is not measured here: it does not change (same blobs, same work).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "turborag_integrations" / "data" / "handdev" / "handdev.jsonl"


def main(argv=None) -> int:
    from turborag_integrations.core.models import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--limit", type=int, default=12, help="items (documents) to encode")
    ap.add_argument("--contexts", default="0,256,1024", help="context_tokens settings")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        settings = [int(x) for x in args.contexts.split(",")]
    except ValueError:
        ap.error(f"--contexts: comma-separated whole numbers, not {args.contexts!r}")
    if any(s < 0 for s in settings) or 0 not in settings:
        ap.error("--contexts: numbers ≥ 0, 0 among them (the baseline)")
    if args.repeats < 1 or args.limit < 1:
        ap.error("--repeats and --limit must be at least 1")

    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.prefill.context import document_contexts
    from turborag_integrations.evaluation.harness import load_items

    items = load_items(args.data).items[:args.limit]
    if not items:
        print(f"error: no items in {args.data}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="turborag-ingest-") as tmp:
        first = TurboRAGEngine(args.model, store=tmp, progress=False, context_tokens=0)
        engines = {n: TurboRAGEngine(first.loaded, store=tmp, progress=False, context_tokens=n)
                   for n in settings}
        work = {}
        for n, engine in engines.items():
            enc = engine.encoder
            chunks = [c for it in items for c in it.chunks]
            contexts = [c for it in items for c in document_contexts(it.chunks, n)]
            ids = [enc.tokenize(c) for c in chunks]
            ctx = [enc.context_ids(b, len(i), c) for b, i, c in zip(contexts, ids, chunks)]
            work[n] = (ids, ctx)
        first.encoder.encode_ids(work[0][0][:2])  # warm-up, untimed
        times: dict[int, list[float]] = {n: [] for n in settings}
        for _ in range(args.repeats):
            for n in settings:  # interleaved: a noisy stretch costs every setting alike
                ids, ctx = work[n]
                start = time.perf_counter()
                engines[n].encoder.encode_ids(ids, contexts=ctx)
                times[n].append(time.perf_counter() - start)
    base = statistics.median(times[0])
    rows = [{"context_tokens": n, "chunks": len(work[n][0]),
             "chunk_tokens": sum(map(len, work[n][0])),
             "context_tokens_encoded": sum(map(len, work[n][1])),
             "median_s": statistics.median(times[n]), "runs_s": times[n],
             "ratio_vs_0": statistics.median(times[n]) / base} for n in settings]
    report = {"data": str(args.data), "model": args.model, "items": len(items),
              "repeats": args.repeats, "results": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{len(items)} documents of {args.data.name}, {args.model}, median of {args.repeats}")
    print(f"{'context_tokens':>14} {'chunks':>7} {'chunk tok':>10} {'context tok':>12} "
          f"{'median s':>9} {'vs 0':>6}")
    for r in rows:
        print(f"{r['context_tokens']:>14} {r['chunks']:>7} {r['chunk_tokens']:>10} "
              f"{r['context_tokens_encoded']:>12} {r['median_s']:>9.2f} {r['ratio_vs_0']:>5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
