"""Decode speed: stock transformers `generate` vs the engine's decode loop, side by side.

    python benchmarks/decode.py                        # 512, 4K and 8K tokens of context, 64 tokens
    python benchmarks/decode.py --contexts 512 4096 --runs 1 --json

For each context size one RAG prompt (sample documents + a question, chat template) is built.
Per run, interleaved:
- stock: `model.generate` (greedy, DynamicCache, full prefill); a streamer stamps every token,
  so decode tokens/s = (tokens − 1) / (last stamp − first new-token stamp): the prefill is not
  counted. At the end-to-end context (--e2e-context) its whole wall time is also the "naive"
  end-to-end figure (full prefill + stock decode of --new-tokens tokens).
- engine: the TurboRAG stitched prefill once, then `decode_loop` over a copy of its cache
  (fp32 fast path, then int8 if available), timed from the first token to the last.
- turbo end-to-end: `TurboRAGEngine.generate` (chunks read from the store on disk, stitched
  prefill, decode) of --new-tokens tokens, EOS ignored on both sides.
int8 agreement: greedy answers (up to --agreement-tokens tokens or EOS) of the int8 and fp32 fast
paths on --agreement-prompts short RAG prompts plus the benchmark prompts: the fraction that are
token-identical. Medians over --runs runs.
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

from turborag_integrations.core.decode import FastDecoder, int8_available
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.generate import GenerationConfig, decode_loop
from turborag_integrations.core.models import DEFAULT_MODEL
from turborag_integrations.core.store import KVStore

SAMPLE_DOCS = Path(__file__).resolve().parents[1] / "turborag_integrations" / "data" / "sample_docs"
QUESTIONS = [
    "Which town's lighthouse can be seen from the farthest away?",
    "Who was the radio operator of the expedition?",
    "What does the company build, and where?",
    "Summarise the documents in two sentences.",
    "What year is mentioned first in the documents?",
    "Name three people mentioned in the documents.",
    "What went wrong during the expedition?",
    "What is the harbor town known for?",
]


def make_chunks(tokenizer, n: int, tokens: int, offset: int = 0) -> list[str]:
    """n distinct chunks of real prose, about `tokens` tokens each."""
    text = "\n\n".join(p.read_text() for p in sorted(SAMPLE_DOCS.glob("*.md")))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = []
    for i in range(n):
        start = (offset + i * 197) % len(ids)
        window = (ids[start:] + ids)[: tokens - 8]
        chunks.append(f"[Document {i + 1}] " + tokenizer.decode(window).strip())
    return chunks


def rag_prompt(engine: TurboRAGEngine, context: int, question: str, offset: int = 0):
    n = max(1, round(context / 512))
    per_chunk = max(16, (min(context, engine.context_window - 256) - 80) // n)
    chunks = make_chunks(engine.tokenizer, n, per_chunk, offset)
    engine.encode_chunks(chunks)
    messages = [{"role": "system", "content": "Answer using only the documents."},
                {"role": "user", "content": "Documents:\n\n" + "\n\n".join(chunks)
                 + f"\n\nQuestion: {question}"}]
    return engine.render_chat(messages), chunks


class StepTimes:
    """A generate() streamer that only records when each put() happens."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def stock_generate(engine: TurboRAGEngine, prompt: str, new_tokens: int) -> dict:
    model, tok = engine.model, engine.tokenizer
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
    streamer = StepTimes()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, streamer=streamer, pad_token_id=tok.eos_token_id)
    total = time.perf_counter() - t0
    t = streamer.times  # [prompt, token 1 (after prefill), token 2, ...]
    steps = len(t) - 2
    return {"tps": steps / (t[-1] - t[1]), "total_s": total, "prefill_s": t[1] - t0,
            "tokens": out[0, ids["input_ids"].shape[1]:].tolist(),
            "context": ids["input_ids"].shape[1]}


def engine_decode(engine: TurboRAGEngine, pre, new_tokens: int, quantize: str | None,
                  eos: set[int] = frozenset()) -> tuple[float, list[int]]:
    """Decode from a copy of a stitched prefill; (tokens/s, tokens)."""
    cache = pre.cache.clone()
    config = GenerationConfig(max_new_tokens=new_tokens, quantize=quantize)
    tokens, t1 = [], None
    for token in decode_loop(engine.model, cache, pre.logits, pre.next_position, config, set(eos)):
        if t1 is None:
            t1 = time.perf_counter()
        tokens.append(token)
    t2 = time.perf_counter()
    steps = len(tokens) - 1
    return (steps / (t2 - t1) if steps > 0 else float("nan")), tokens


def turbo_prefill(engine: TurboRAGEngine, prompt: str, chunks: list[str], reserve: int):
    segments, hits, _ = engine.segments(prompt, chunks)
    if hits != len(chunks):
        raise RuntimeError(f"only {hits}/{len(chunks)} chunks were reused")
    return engine.prefill(segments, reserve=reserve)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 8192],
                    help="approximate context sizes in tokens (default 512 4096 8192)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per run (default 64)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs (median), after one warm-up")
    ap.add_argument("--e2e-context", type=int, default=4096,
                    help="context of the end-to-end comparison (one of --contexts; 0 = skip)")
    ap.add_argument("--no-int8", action="store_true", help="skip the int8 decode mode")
    ap.add_argument("--agreement-prompts", type=int, default=16,
                    help="extra short (≈512-token) prompts for int8 agreement (default 16)")
    ap.add_argument("--agreement-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    int8 = not args.no_int8 and int8_available()
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))

    with tempfile.TemporaryDirectory() as tmp:
        engine = TurboRAGEngine(args.model, store=KVStore(tmp, memory_bytes=0), progress=False)
        engine.warmup()
        model = engine.model
        if FastDecoder.for_model(model) is None:
            say("note: this model is not supported by the fast path; the engine uses stock steps")
        if int8:
            t = time.perf_counter()
            FastDecoder.for_model(model, "int8")
            say(f"int8 weights built in {time.perf_counter() - t:.1f}s")
        results, e2e, answers = [], None, []
        for context in args.contexts:
            prompt, chunks = rag_prompt(engine, context, QUESTIONS[0])
            pre = turbo_prefill(engine, prompt, chunks, args.new_tokens)
            rows = {"stock": [], "engine": [], "int8": [], "naive": [], "turbo": []}
            stock_tokens = fast_tokens = int8_tokens = None
            for run in range(args.runs + 1):  # the first round is a warm-up
                s = stock_generate(engine, prompt, args.new_tokens) if run or context <= 1024 else None
                tps, fast_tokens = engine_decode(engine, pre, args.new_tokens, None)
                tps8, int8_tokens = engine_decode(engine, pre, args.new_tokens, "int8") if int8 \
                    else (float("nan"), None)
                turbo_s = None
                if context == args.e2e_context:
                    saved, engine.eos_ids = engine.eos_ids, set()  # 64 tokens on both sides
                    try:
                        t = time.perf_counter()
                        r = engine.generate(prompt, chunks=chunks,
                                            config=GenerationConfig(max_new_tokens=args.new_tokens))
                        turbo_s = time.perf_counter() - t
                    finally:
                        engine.eos_ids = saved
                    if r.stats.cache_hits != len(chunks):
                        raise RuntimeError("end-to-end run did not reuse every chunk")
                if run == 0:
                    continue
                stock_tokens = s["tokens"]
                rows["stock"].append(s["tps"])
                rows["engine"].append(tps)
                rows["int8"].append(tps8)
                if turbo_s is not None:
                    rows["naive"].append(s["total_s"])
                    rows["turbo"].append(turbo_s)
                say(f"  {context}: stock {s['tps']:.2f} tok/s (prefill {s['prefill_s']:.1f}s), "
                    f"engine {tps:.2f}, int8 {tps8:.2f}"
                    + (f"; e2e naive {s['total_s']:.1f}s turbo {turbo_s:.1f}s" if turbo_s else ""))
            row = {"context_tokens": len(pre.plan.token_ids),
                   "stock_tps": statistics.median(rows["stock"]),
                   "engine_tps": statistics.median(rows["engine"])}
            if int8:
                row["engine_int8_tps"] = statistics.median(rows["int8"])
                row["int8_same_tokens"] = int8_tokens == fast_tokens
            # The stitched prompt is not the full-attention prompt; this is only a sanity check.
            row["engine_vs_stock_first_token_same"] = bool(fast_tokens[:1] == stock_tokens[:1])
            row["speedup"] = row["engine_tps"] / row["stock_tps"]
            results.append(row)
            if rows["turbo"]:
                naive, turbo = statistics.median(rows["naive"]), statistics.median(rows["turbo"])
                e2e = {"context_tokens": len(pre.plan.token_ids), "new_tokens": args.new_tokens,
                       "naive": naive, "turbo": turbo, "speedup": naive / turbo}
            if int8:
                answers.append((fast_tokens, int8_tokens))
            engine.cache_pool.release(pre.cache)
            say(f"... {context} done")

        agreement = None
        if int8:
            eos = engine.eos_ids
            for i in range(args.agreement_prompts):
                prompt, chunks = rag_prompt(engine, 512, QUESTIONS[i % len(QUESTIONS)],
                                            offset=1000 + 331 * i)
                pre = turbo_prefill(engine, prompt, chunks, args.agreement_tokens)
                _, a = engine_decode(engine, pre, args.agreement_tokens, None, eos)
                _, b = engine_decode(engine, pre, args.agreement_tokens, "int8", eos)
                engine.cache_pool.release(pre.cache)
                answers.append((a, b))
            same = [a == b for a, b in answers]

            def prefix(a, b):
                n = 0
                while n < min(len(a), len(b)) and a[n] == b[n]:
                    n += 1
                return n / max(len(a), 1)
            agreement = {"int8_agreement": sum(same) / len(same), "int8_prompts": len(same),
                         "int8_mean_matching_prefix": statistics.mean(prefix(a, b) for a, b in answers)}

    report = {"model": args.model, "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
              "runs": args.runs, "results": results, "end_to_end_s": e2e}
    if agreement:
        report.update(agreement)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model {args.model}, {torch.get_num_threads()} threads, {args.new_tokens} new tokens, "
          f"median of {args.runs} runs")
    print(f"{'context':>8} {'stock tok/s':>12} {'engine tok/s':>13} {'int8 tok/s':>11} {'speedup':>8}")
    for r in results:
        print(f"{r['context_tokens']:>8} {r['stock_tps']:>12.2f} {r['engine_tps']:>13.2f} "
              f"{r.get('engine_int8_tps', float('nan')):>11.2f} {r['speedup']:>7.1f}x")
    if e2e:
        print(f"end to end, {e2e['new_tokens']} tokens over {e2e['context_tokens']} tokens: naive "
              f"{e2e['naive']:.1f}s, TurboRAG {e2e['turbo']:.1f}s ({e2e['speedup']:.1f}x)")
    if agreement:
        print(f"int8 greedy answers identical to fp32 on {agreement['int8_agreement']:.0%} of "
              f"{agreement['int8_prompts']} prompts (mean matching prefix "
              f"{agreement['int8_mean_matching_prefix']:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
