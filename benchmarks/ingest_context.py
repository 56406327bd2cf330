"""What each ingestion-time knob costs: chunk encoding time and blob bytes with context_tokens
0, 256, 1024, then the learned chunk encoder and one lead blob per chunk on top of the largest.

    python benchmarks/ingest_context.py                          # bundled SmolLM2, 12 dev items
    python benchmarks/ingest_context.py --model qwen2.5-coder-0.5b-instruct --limit 6 --json

Rows: "context N" (training-free encoding after up to N tokens of the document), "+ encoder"
(the model's shipped chunk encoder on top of the largest context; models without one skip it),
"+ lead blob" (each chunk also encoded right after one prompt head, as lead blobs are: one more
blob per chunk and head). Bytes are the blobs' keys and values as stored (the model's dtype).

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
# the stock LlamaIndex query engine's head as SmolLM2's chat template renders it (a lead blob's
# cost depends on the head's length only)
HEAD = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nContext information is below.\n"
        "---------------------\n")


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
    from turborag_integrations.core.prefill.chunk_encoder import ChunkEncoder
    from turborag_integrations.core.prefill.context import document_contexts
    from turborag_integrations.core.prefill.encoding import resolve_encoder
    from turborag_integrations.evaluation.harness import load_items

    def blob_bytes(blobs) -> int:
        return sum(b.keys.numel() * b.keys.element_size() + b.values.numel()
                   * b.values.element_size() for b in blobs)

    items = load_items(args.data).items[:args.limit]
    if not items:
        print(f"error: no items in {args.data}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="turborag-ingest-") as tmp:
        first = TurboRAGEngine(args.model, store=tmp, progress=False, context_tokens=0,
                               encoder=None)
        top = max(settings)
        names = [f"context {n}" for n in settings]
        engines = {f"context {n}": TurboRAGEngine(first.loaded, store=tmp, progress=False,
                                                  context_tokens=n, encoder=None)
                   for n in settings}
        if resolve_encoder("default", first.loaded.name, first.fingerprint.weights) is not None:
            names.append("+ encoder")
            engines["+ encoder"] = TurboRAGEngine(first.loaded, store=tmp, progress=False,
                                                  context_tokens=top, encoder="default")
        work = {}
        for name in names:
            enc = engines[name].library.encoder
            n = enc.context_tokens
            chunks = [c for it in items for c in it.chunks]
            contexts = [c for it in items for c in document_contexts(it.chunks, n)]
            ids = [enc.tokenize(c) for c in chunks]
            ctx = [enc.context_ids(b, len(i), c) for b, i, c in zip(contexts, ids, chunks)]
            work[name] = (enc, ids, ctx)
        # a lead blob: the chunk right after a prompt head (no context: the head is what is
        # before it in the prompt), one more encoding and blob per chunk and head
        base = engines[names[-1]].library.encoder
        head = first.tokenizer(HEAD, add_special_tokens=False)["input_ids"]
        lead = ChunkEncoder(base.model, base.tokenizer, base.fingerprint,
                            batch_size=base.batch_size, anchor_ids=head)
        names.append("+ lead blob")
        work["+ lead blob"] = (lead, work[names[-2]][1], [[] for _ in work[names[-2]][1]])
        first.library.encoder.encode_ids(work[names[0]][1][:2])  # warm-up, untimed
        times: dict[str, list[float]] = {name: [] for name in names}
        sizes: dict[str, int] = {}
        for _ in range(args.repeats):
            for name in names:  # interleaved: a noisy stretch costs every setting alike
                enc, ids, ctx = work[name]
                start = time.perf_counter()
                blobs = enc.encode_ids(ids, contexts=ctx)
                times[name].append(time.perf_counter() - start)
                sizes[name] = blob_bytes(blobs)
    base_s = statistics.median(times[names[0]])
    rows, total_s, total_bytes = [], 0.0, 0
    for name in names:
        enc, ids, ctx = work[name]
        median = statistics.median(times[name])
        # the lead blob comes on top of the row before it: its cost adds, its bytes add
        total_s = total_s + median if name == "+ lead blob" else median
        total_bytes = total_bytes + sizes[name] if name == "+ lead blob" else sizes[name]
        rows.append({"setting": name, "context_tokens": enc.context_tokens,
                     "chunks": len(ids), "chunk_tokens": sum(map(len, ids)),
                     "context_tokens_encoded": sum(map(len, ctx)),
                     "median_s": median, "runs_s": times[name], "total_s": total_s,
                     "ratio_vs_0": total_s / base_s, "bytes": total_bytes,
                     "bytes_vs_0": total_bytes / sizes[names[0]]})
    report = {"data": str(args.data), "model": args.model, "items": len(items),
              "repeats": args.repeats, "results": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{len(items)} documents of {args.data.name}, {args.model}, median of {args.repeats}")
    print(f"{'setting':>14} {'chunks':>7} {'chunk tok':>10} {'context tok':>12} "
          f"{'median s':>9} {'time vs 0':>10} {'MB stored':>10} {'bytes vs 0':>11}")
    for r in rows:
        print(f"{r['setting']:>14} {r['chunks']:>7} {r['chunk_tokens']:>10} "
              f"{r['context_tokens_encoded']:>12} {r['median_s']:>9.2f} "
              f"{r['ratio_vs_0']:>9.1f}x {r['bytes'] / 2**20:>10.1f} {r['bytes_vs_0']:>10.1f}x")
    print("time and bytes vs 0: the setting with everything above it, against chunks encoded "
          "alone (a lead blob adds its encoding and its blobs to the row above)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
