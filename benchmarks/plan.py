"""The capacity planner against the ingestion it predicts: `turborag store plan`'s bytes and hours
beside what `encode_chunks` then writes and takes for the same corpus shape, in one run.

    python benchmarks/plan.py                                  # 1,000 chunks of 100 tokens
    python benchmarks/plan.py --chunks 1000 --chunk-tokens 100 --storage-dtype int8 --heads 1 --json

The corpus is synthetic text of exactly `--chunk-tokens` tokens a chunk (random ordinary tokens,
decoded and checked to tokenize back to themselves), each chunk after the previous one as its
document's context when `--context-tokens` is set, with `--heads` prompt heads. The planner's
calibration runs first (a blob written, one batch encoded), then the whole corpus is ingested
into a fresh store; the table gives both figures and their ratio.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from turborag_integrations.core.engine import TurboRAGEngine  # noqa: E402
from turborag_integrations.core.planner import CorpusShape, calibrate, plan  # noqa: E402
from turborag_integrations.core.store import KVStore, StoreConfig  # noqa: E402


def exact_texts(tokenizer, count: int, tokens: int, seed: int = 0) -> list[str]:
    """`count` texts of exactly `tokens` tokens each (redrawn until they round-trip)."""
    generator = torch.Generator().manual_seed(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w[:1] in ("Ġ", "▁")
                   and w[1:].isascii() and w[1:].isalpha())[:20000]
    texts = []
    while len(texts) < count:
        picked = torch.randint(0, len(words), (tokens,), generator=generator).tolist()
        text = tokenizer.convert_tokens_to_string([words[i] for i in picked]).strip()
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > tokens:
            text = tokenizer.decode(ids[:tokens])
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) == tokens:
            texts.append(text)
    return texts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--chunk-tokens", type=int, default=100)
    parser.add_argument("--storage-dtype", default="native")
    parser.add_argument("--heads", type=int, default=0)
    parser.add_argument("--context-tokens", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    shape = CorpusShape(args.chunks, args.chunk_tokens, args.heads, args.context_tokens)
    heads = tuple(f"Prompt head {i}: answer from the context below.\n\n"
                  for i in range(args.heads))
    with tempfile.TemporaryDirectory(prefix="turborag-plan-bench-") as folder:
        root = Path(folder)
        store = KVStore(root / "kv", storage_dtype=args.storage_dtype, memory_bytes=0,
                        remote_url="")
        with TurboRAGEngine(args.model, store=store, context_tokens=args.context_tokens,
                            prompt_heads=heads, progress=False) as engine:
            report = plan(shape, calibrate(engine, shape, storage_dtype=args.storage_dtype),
                          StoreConfig(storage_dtype=args.storage_dtype), root=root)
            texts = exact_texts(engine.tokenizer, args.chunks, args.chunk_tokens)
            contexts = [None] + texts[:-1] if args.context_tokens else None
            start = time.perf_counter()
            engine.encode_chunks(texts, contexts=contexts)
            seconds = time.perf_counter() - start
            usage = store.disk_usage()
        store.close()
    result = {"model": report["calibration"]["model"], "shape": report["shape"],
              "storage_dtype": args.storage_dtype,
              "planned_bytes": report["corpus_bytes"], "written_bytes": usage["bytes"],
              "planned_blobs": report["blobs"], "written_blobs": usage["blobs"],
              "bytes_ratio": usage["bytes"] / report["corpus_bytes"],
              "planned_hours": report["encode_hours"], "measured_hours": seconds / 3600,
              "hours_ratio": seconds / 3600 / report["encode_hours"]}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{args.chunks:,} chunks of {args.chunk_tokens} tokens, {args.heads} head(s), "
          f"{args.context_tokens} context tokens, {args.storage_dtype}, {result['model']}")
    print(f"{'':10} {'planned':>16} {'ingestion':>16} {'ratio':>7}")
    print(f"{'blobs':10} {result['planned_blobs']:>16,} {result['written_blobs']:>16,} "
          f"{result['written_blobs'] / result['planned_blobs']:>7.3f}")
    print(f"{'bytes':10} {result['planned_bytes']:>16,} {result['written_bytes']:>16,} "
          f"{result['bytes_ratio']:>7.4f}")
    print(f"{'seconds':10} {result['planned_hours'] * 3600:>16.1f} "
          f"{result['measured_hours'] * 3600:>16.1f} {result['hours_ratio']:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
