"""KV store: bytes per token for each storage dtype, cold and warm load, prefetch, int8 fidelity.

    python benchmarks/kv_store.py            # table
    python benchmarks/kv_store.py --json     # one JSON object

- bytes_per_token: blob file size / tokens, for native (the model's dtype), bfloat16, float16, int8.
- load_s: time to get 8 × 512-token blobs and write them into a KV cache (what TTFT pays),
  cold (each file dropped from the page cache first, with posix_fadvise) and warm (memory tier).
- prefetch: TurboRAG TTFT from a cold page cache with and without prefetching the blobs.
- int8: over ≥ 50 RAG prompts, how often the greedy answer (16 tokens) from int8 blobs equals the
  answer from native blobs, and the largest |Δ logit| of the first token.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import make_chunks  # noqa: E402

from turborag_integrations.core.retrieval.chunking import split_text  # noqa: E402
from turborag_integrations.core.engine import TurboRAGEngine  # noqa: E402
from turborag_integrations.core.settings import GenerationConfig  # noqa: E402
from turborag_integrations.core.models import DEFAULT_MODEL, load_model  # noqa: E402
from turborag_integrations.core.prefill.stitch import assemble, plan_prompt, Segment  # noqa: E402
from turborag_integrations.core.store import KVStore  # noqa: E402
from turborag_integrations.core.prompt_template import render_chat

SAMPLE_DOCS = Path(__file__).resolve().parents[1] / "turborag_integrations" / "data" / "sample_docs"
QUESTIONS = [
    "How high is the Tall Widow lighthouse?", "When was Velmora founded?",
    "How many inhabitants does Velmora have?", "Who won the Lantern Regatta in 2019?",
    "What is the trophy of the Lantern Regatta called?", "Who is the mayor of Velmora?",
    "How much salt do the Velmora salt pans produce?", "What is Spinewater made from?",
    "When did the railway reach Velmora?", "Which bakery has the original fennel bread recipe?",
    "Who founded the Orbital Kiln Company?", "What is the Ember-7?",
    "How many people does Orbital Kiln employ?", "Who is the chief executive of Orbital Kiln?",
    "What is the name of the company mascot?", "Why were tiles recalled in 2020?",
    "Where is the second Orbital Kiln plant?", "Who led the Haldor Glacier expedition?",
    "How long did the Haldor Glacier expedition last?", "Who was the radio operator?",
    "What was the greatest ice thickness measured?", "What was the name of the lead dog?",
    "Which ship picked up the team?", "Who was the youngest member of the team?",
    "When was the memorial stone unveiled?",
]


def drop_page_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_and_assemble(engine, store, keys, texts):
    t0 = time.perf_counter()
    blobs = [store.get(k, engine.fingerprint) for k in keys]
    plan = plan_prompt([Segment(t, b) for t, b in zip(texts, blobs)] + [Segment("?")],
                       engine.tokenizer)
    cache = assemble(engine.model, plan, engine.rotator, len(plan.token_ids) + 1, engine.cache_pool)
    elapsed = time.perf_counter() - t0
    engine.cache_pool.release(cache)
    return elapsed


def rag_prompts(engine, n: int, seed: int = 0):
    chunks = []
    for path in sorted(SAMPLE_DOCS.glob("*.md")):
        chunks += split_text(path.read_text(), engine.tokenizer, 128)
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < n:
        q = QUESTIONS[len(prompts) % len(QUESTIONS)]
        picked = rng.sample(chunks, 3)
        messages = [{"role": "system", "content": "Answer using only the context."},
                    {"role": "user", "content": "Context:\n\n" + "\n\n".join(picked)
                     + f"\n\nQuestion: {q}"}]
        prompts.append((render_chat(engine.tokenizer, messages), picked))
    return chunks, prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    loaded = load_model(args.model, progress=not args.json)
    out: dict = {"model": args.model}
    with tempfile.TemporaryDirectory() as tmp:
        stores = {d: KVStore(Path(tmp) / d, memory_bytes=0, storage_dtype=d)
                  for d in ("native", "bfloat16", "float16", "int8")}
        engines = {d: TurboRAGEngine(loaded, store=s) for d, s in stores.items()}
        native = engines["native"]
        texts = make_chunks(native.tokenizer, 8, 512)
        tokens = sum(len(native.library.encoder.tokenize(t)) for t in texts)
        out["bytes_per_token"] = {}
        for d, engine in engines.items():
            keys = engine.encode_chunks(texts)
            out["bytes_per_token"][d] = stores[d].disk_usage()["bytes"] / tokens
        out["bytes_per_token"]["model_dtype"] = native.fingerprint.dtype

        # Cold and warm load of the native blobs.
        keys = native.encode_chunks(texts)
        paths = [stores["native"].disk.path(k) for k in keys]
        warm_store = KVStore(Path(tmp) / "native", memory_bytes=4 << 30)
        cold, warm = [], []
        load_and_assemble(native, warm_store, keys, texts)  # warm-up; fills the memory tier
        for _ in range(args.runs):
            drop_page_cache(paths)
            with KVStore(Path(tmp) / "native", memory_bytes=0) as cold_store:
                cold.append(load_and_assemble(native, cold_store, keys, texts))
            warm.append(load_and_assemble(native, warm_store, keys, texts))
        out["load_s"] = {"cold": statistics.median(cold), "warm": statistics.median(warm)}

        # Prefetch: TTFT from a cold page cache, with and without it.
        prompt = render_chat(native.tokenizer, [
            {"role": "user", "content": "\n\n".join(texts) + "\n\nQ: why?"}])
        one = GenerationConfig(max_new_tokens=1)
        native.generate(prompt, chunks=texts, config=one)
        ttft = {"off": [], "on": []}
        for _ in range(args.runs):
            for mode in ("off", "on"):
                drop_page_cache(paths)
                with KVStore(Path(tmp) / "native", memory_bytes=2 << 30) as native.store:
                    native.config = native.config.with_settings(prefetch=mode == "on")
                    ttft[mode].append(native.generate(prompt, chunks=texts, config=one).stats.ttft_s)
        native.config = native.config.with_settings(prefetch=False)
        out["prefetch_ttft_s"] = {k: statistics.median(v) for k, v in ttft.items()}

        # int8 fidelity against native blobs on RAG prompts.
        chunks, prompts = rag_prompts(native, args.prompts)
        native.store = stores["native"]
        for engine in (native, engines["int8"], engines["bfloat16"]):
            engine.encode_chunks(chunks)
        config = GenerationConfig(max_new_tokens=16)
        agree = {"int8": 0, "bfloat16": 0}
        dlogit = {"int8": 0.0, "bfloat16": 0.0}
        for prompt, picked in prompts:
            a = native.generate(prompt, chunks=picked, config=config)
            la = native.prefill(native.assembly.segments(prompt, picked)[0]).logits
            for d in agree:
                b = engines[d].generate(prompt, chunks=picked, config=config)
                agree[d] += a.token_ids == b.token_ids
                lb = engines[d].prefill(engines[d].assembly.segments(prompt, picked)[0]).logits
                dlogit[d] = max(dlogit[d], (la - lb).abs().max().item())
        out["int8_agreement"] = agree["int8"] / len(prompts)
        out["int8_max_abs_dlogit"] = dlogit["int8"]
        out["bfloat16_agreement"] = agree["bfloat16"] / len(prompts)
        out["bfloat16_max_abs_dlogit"] = dlogit["bfloat16"]
        out["int8_prompts"] = len(prompts)
    if args.json:
        print(json.dumps(out))
        return 0
    bpt = out["bytes_per_token"]
    print(f"model {args.model} ({bpt['model_dtype']})")
    print("bytes per token: " + ", ".join(f"{d} {v:,.0f}" for d, v in bpt.items() if d != "model_dtype"))
    print(f"int8 / bfloat16 bytes: {bpt['int8'] / bpt['bfloat16']:.3f}")
    print(f"load + assemble 8 × 512 tokens: cold {out['load_s']['cold']:.3f}s, "
          f"warm {out['load_s']['warm']:.3f}s (median of {args.runs})")
    print(f"TTFT from a cold page cache: prefetch off {out['prefetch_ttft_s']['off']:.3f}s, "
          f"on {out['prefetch_ttft_s']['on']:.3f}s")
    print(f"int8 vs native: greedy answers agree on {out['int8_agreement']:.1%} of "
          f"{out['int8_prompts']} prompts; max |Δ logit| {out['int8_max_abs_dlogit']:.3f}")
    print(f"bfloat16 vs native (for reference): {out['bfloat16_agreement']:.1%}; "
          f"max |Δ logit| {out['bfloat16_max_abs_dlogit']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
