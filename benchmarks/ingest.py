"""Ingestion against the forward pass it is built on: tokens/s of `encode_chunks` (encoding,
blob extraction, checksums and disk writes) beside a plain batched forward of the same padded
batches, in one run.

    python benchmarks/ingest.py                                   # bundled SmolLM2
    python benchmarks/ingest.py --model qwen2.5-coder-0.5b-instruct --chunks 32 --json

The corpus is the hand-written dev set's documents, each cut into its sections as the vector
stores ingest them. Per setting ("plain": chunks encoded alone, `context_tokens=0`; "context":
the default, each chunk after up to 1024 tokens of its document), the same chunks are encoded
into a fresh store (`TurboRAGEngine.encode_chunks`), and the same batches — the encoder's
order, padding and batch size, the context tokens in front — go once through the model's own
forward with nothing kept (`model(input_ids, attention_mask)`, the last logits only). Rounds
alternate between the two; the table gives medians, tokens/s counted in the tokens the forward
reads (chunk and context), and ingestion's share of the forward's throughput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "turborag_integrations" / "data" / "handdev" / "handdev.jsonl"


def corpus(path: Path, limit: int) -> tuple[list[str], list[str | None]]:
    """Up to `limit` chunks: each item's sections in order, with the text before each."""
    texts, befores = [], []
    for line in path.read_text().splitlines():
        chunks = json.loads(line)["chunks"]
        for i, chunk in enumerate(chunks):
            texts.append(chunk)
            befores.append("\n\n".join(chunks[:i]) or None)
            if len(texts) == limit:
                return texts, befores
    return texts, befores


def batches(encoder, texts, befores) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The padded (input_ids, attention_mask) batches `encode_ids` runs for these chunks."""
    ids = [encoder.tokenize(t) for t in texts]
    contexts = [encoder.context_ids(b, len(i), t) for b, i, t in zip(befores, ids, texts)]
    heads = [len(encoder.anchor_ids) + len(c) + encoder.num_soft for c in contexts]
    order = sorted(range(len(ids)), key=lambda i: heads[i] + len(ids[i]))
    out = []
    for start in range(0, len(order), encoder.batch_size):
        batch = order[start:start + encoder.batch_size]
        rows = [encoder.anchor_ids + list(contexts[i]) + [0] * encoder.num_soft + ids[i]
                for i in batch]
        width = max(map(len, rows))
        input_ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):
            input_ids[r, :len(row)] = torch.as_tensor(row)
            mask[r, :len(row)] = 1
        out.append((input_ids, mask))
    return out


def main(argv=None) -> int:
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.models import DEFAULT_MODEL, load_model
    from turborag_integrations.core.store import KVStore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--chunks", type=int, default=48, help="chunks to ingest per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.rounds < 1:
        ap.error("--chunks and --rounds must be at least 1")

    texts, befores = corpus(args.data, args.chunks)
    loaded = load_model(args.model, progress=not args.json)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, context_tokens in (("plain", 0), ("context", None)):
            settings = {} if context_tokens is None else {"context_tokens": context_tokens}
            probe = TurboRAGEngine(loaded, store=Path(tmp) / "probe", progress=False, **settings)
            work = batches(probe.library.encoder, texts, befores)
            tokens = int(sum(int(m.sum()) for _, m in work))
            ingest_s, forward_s = [], []
            for r in range(args.rounds + 1):  # the first round warms up
                with KVStore(Path(tmp) / f"{name}-{r}", memory_bytes=0) as store:
                    engine = TurboRAGEngine(loaded, store=store, progress=False, **settings)
                    t0 = time.perf_counter()
                    engine.encode_chunks(texts, contexts=befores)
                    t1 = time.perf_counter()
                with torch.inference_mode():
                    for input_ids, mask in work:
                        loaded.model(input_ids=input_ids, attention_mask=mask, logits_to_keep=1)
                t2 = time.perf_counter()
                if r:
                    ingest_s.append(t1 - t0)
                    forward_s.append(t2 - t1)
            ingest, forward = statistics.median(ingest_s), statistics.median(forward_s)
            rows.append({"setting": name, "chunks": len(texts), "batches": len(work),
                         "tokens": tokens, "ingest_s": ingest, "forward_s": forward,
                         "ingest_tokens_per_s": tokens / ingest,
                         "forward_tokens_per_s": tokens / forward, "share": forward / ingest})
    report = {"model": args.model, "threads": torch.get_num_threads(), "rounds": args.rounds,
              "rows": rows}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model {args.model}, {torch.get_num_threads()} threads, median of {args.rounds} "
          "rounds; tokens = what the forward reads (chunk and context)")
    print(f"{'setting':>8} {'chunks':>6} {'tokens':>7} {'ingest':>9} {'forward':>9} "
          f"{'ingest tok/s':>12} {'forward tok/s':>13} {'share':>6}")
    for r in rows:
        print(f"{r['setting']:>8} {r['chunks']:>6} {r['tokens']:>7} {r['ingest_s']:>8.2f}s "
              f"{r['forward_s']:>8.2f}s {r['ingest_tokens_per_s']:>12.0f} "
              f"{r['forward_tokens_per_s']:>13.0f} {r['share']:>6.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
