"""Decode speed: stock transformers `generate` vs the engine's decode loop, side by side.

    python benchmarks/decode.py                        # 512, 4K and 8K tokens of context, 64 tokens
    python benchmarks/decode.py --contexts 512 4096 --runs 1 --json

For each context size one RAG prompt (sample documents + a question, chat template) is built.
Per run, interleaved:
- stock: `model.generate` (greedy, DynamicCache, full prefill); a streamer stamps every token,
  so decode tokens/s = (tokens − 1) / (last stamp − first new-token stamp): the prefill is not
  counted. At the end-to-end context (--e2e-context) its whole wall time is also the "naive"
  end-to-end figure (full prefill + stock decode of --new-tokens tokens).
- engine modes, each decoding from a copy of one TurboRAG stitched prefill, timed from the
  first token to the last: `engine` (fp32 fast path, matmul formulation picked on this machine),
  `linear` (fp32 fast path with F.linear: bit-identical to stock steps), `int8` (int8 weights),
  `draft_int8` / `draft_bf16` (self-speculative: quantised drafts verified in fp32).
- turbo end-to-end: `TurboRAGEngine.generate` (chunks read from the store on disk, stitched
  prefill, decode) of --new-tokens tokens, EOS ignored on both sides; plain and with int8 drafts.
Agreement: greedy answers (up to --agreement-tokens tokens or EOS) of each mode against the
`engine` mode, on --agreement-prompts short RAG prompts plus the benchmark prompts: the fraction
that are token-identical. Medians over --runs runs.
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

from turborag_integrations.core.decode.fast import FastDecoder
from turborag_integrations.core.decode.matmul import int8_available
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.decode.loop import decode_loop
from turborag_integrations.core.decode.start import DecodeStart
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.models import DEFAULT_MODEL
from turborag_integrations.core.store import KVStore
from turborag_integrations.core.prompt_template import render_chat

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
    return render_chat(engine.tokenizer, messages), chunks


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


MODES = {  # name: (GenerationConfig options, decode_loop's matmul)
    "engine": ({}, None),  # fp32 fast path, matmul picked on this machine
    "linear": ({}, "linear"),  # fp32 fast path with F.linear: bit-identical to stock steps
    "int8": ({"quantize": "int8"}, None),  # int8 weights: faster, answers drift
    "draft_int8": ({"draft": "int8"}, None),  # int8 drafts verified in fp32
    "draft_bf16": ({"draft": "bf16"}, None),
}


def engine_decode(engine: TurboRAGEngine, pre, new_tokens: int, mode: str,
                  eos: set[int] = frozenset()) -> tuple[float, list[int]]:
    """Decode from a copy of a stitched prefill in `mode` (see MODES); (tokens/s, tokens)."""
    options, matmul = MODES[mode]
    cache = pre.cache.clone()
    config = GenerationConfig(max_new_tokens=new_tokens, **options)
    tokens, t1 = [], None
    for token in decode_loop(engine.model, DecodeStart(cache, pre.logits, pre.next_position), config,
                             set(eos), matmul=matmul):
        if t1 is None:
            t1 = time.perf_counter()
        tokens.append(token)
    t2 = time.perf_counter()
    steps = len(tokens) - 1
    return (steps / (t2 - t1) if steps > 0 else float("nan")), tokens


def turbo_prefill(engine: TurboRAGEngine, prompt: str, chunks: list[str], reserve: int):
    segments, hits, _ = engine.assembly.segments(prompt, chunks)
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
    ap.add_argument("--modes", nargs="+", default=list(MODES),
                    help=f"engine decode modes to compare (default: all of {list(MODES)})")
    ap.add_argument("--agreement-prompts", type=int, default=16,
                    help="extra short (≈512-token) prompts for answer agreement (default 16)")
    ap.add_argument("--agreement-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = [m for m in args.modes if m in MODES]
    if not int8_available():
        modes = [m for m in modes if "int8" not in m]
    modes = ["engine"] + [m for m in modes if m != "engine"]
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr))

    with tempfile.TemporaryDirectory() as tmp:
        engine = TurboRAGEngine(args.model, store=KVStore(tmp, memory_bytes=0), progress=False)
        engine.warmup()
        model = engine.model
        fast = FastDecoder.for_model(model)
        if fast is None:
            say("note: this model is not supported by the fast path; the engine uses stock steps")
        for q in ("int8", "bf16"):
            if any(q in m for m in modes):
                t = time.perf_counter()
                FastDecoder.for_model(model, q)
                say(f"{q} weights built in {time.perf_counter() - t:.1f}s")
        results, e2e, answers = [], None, []
        for context in args.contexts:
            prompt, chunks = rag_prompt(engine, context, QUESTIONS[0])
            pre = turbo_prefill(engine, prompt, chunks, args.new_tokens + 8)
            rows = {m: [] for m in modes + ["stock", "naive", "turbo", "turbo_draft"]}
            tokens = {}
            for run in range(args.runs + 1):  # the first round is a warm-up
                s = stock_generate(engine, prompt, args.new_tokens) if run or context <= 1024 else None
                for m in modes:
                    tps, tokens[m] = engine_decode(engine, pre, args.new_tokens, m)
                    rows[m].append(tps)
                e2e_runs = {}
                if context == args.e2e_context:
                    saved, engine.eos_ids = engine.eos_ids, set()  # 64 tokens on both sides
                    try:
                        for name, options in (("turbo", {}), ("turbo_draft", {"draft": "int8"})):
                            if "draft" in name and "draft_int8" not in modes:
                                continue
                            t = time.perf_counter()
                            r = engine.generate(prompt, chunks=chunks, config=GenerationConfig(
                                max_new_tokens=args.new_tokens, **options))
                            e2e_runs[name] = time.perf_counter() - t
                            if r.stats.cache_hits != len(chunks):
                                raise RuntimeError("end-to-end run did not reuse every chunk")
                    finally:
                        engine.eos_ids = saved
                if run == 0:
                    for m in modes:
                        rows[m].clear()
                    continue
                tokens["stock"] = s["tokens"]
                rows["stock"].append(s["tps"])
                if e2e_runs:
                    rows["naive"].append(s["total_s"])
                    for name, secs in e2e_runs.items():
                        rows[name].append(secs)
                say(f"  {context}: stock {s['tps']:.2f} tok/s (prefill {s['prefill_s']:.1f}s), "
                    + ", ".join(f"{m} {rows[m][-1]:.2f}" for m in modes)
                    + "".join(f"; e2e naive {s['total_s']:.1f}s" if e2e_runs else "")
                    + "".join(f", {k} {v:.1f}s" for k, v in e2e_runs.items()))
            med = statistics.median
            row = {"context_tokens": len(pre.plan.token_ids), "stock_tps": med(rows["stock"]),
                   "engine_tps": med(rows["engine"])}
            for m in modes[1:]:
                row[f"{m}_tps"] = med(rows[m])
                row[f"{m}_same_tokens"] = tokens[m] == tokens["engine"]
            # The stitched prompt is not the full-attention prompt; this is only a sanity check.
            row["engine_vs_stock_first_token_same"] = bool(tokens["engine"][:1] == tokens["stock"][:1])
            row["speedup"] = row["engine_tps"] / row["stock_tps"]
            results.append(row)
            if rows["turbo"]:
                naive = med(rows["naive"])
                e2e = {"context_tokens": len(pre.plan.token_ids), "new_tokens": args.new_tokens,
                       "naive": naive, "turbo": med(rows["turbo"]),
                       "speedup": naive / med(rows["turbo"])}
                if rows["turbo_draft"]:
                    e2e["turbo_draft_int8"] = med(rows["turbo_draft"])
                    e2e["speedup_draft_int8"] = naive / e2e["turbo_draft_int8"]
            answers.append(dict(tokens))
            engine.cache_pool.release(pre.cache)
            say(f"... {context} done")

        # Agreement of every mode's greedy answer with the fp32 fast path's, on short RAG
        # prompts (up to --agreement-tokens tokens or EOS) plus the benchmark prompts.
        eos = engine.eos_ids
        for i in range(args.agreement_prompts):
            prompt, chunks = rag_prompt(engine, 512, QUESTIONS[i % len(QUESTIONS)],
                                        offset=1000 + 331 * i)
            pre = turbo_prefill(engine, prompt, chunks, args.agreement_tokens + 8)
            answers.append({m: engine_decode(engine, pre, args.agreement_tokens, m, eos)[1]
                            for m in modes})
            engine.cache_pool.release(pre.cache)

        def prefix(a, b):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            return n / max(len(a), 1)
        agreement = {m: {"same": sum(a[m] == a["engine"] for a in answers) / len(answers),
                         "mean_matching_prefix": statistics.mean(prefix(a["engine"], a[m])
                                                                 for a in answers)}
                     for m in modes[1:]}

    report = {"model": args.model, "threads": torch.get_num_threads(),
              "matmul": fast.matmul if fast else None, "new_tokens": args.new_tokens,
              "runs": args.runs, "results": results, "end_to_end_s": e2e,
              "agreement_prompts": len(answers), "agreement": agreement}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"model {args.model}, {torch.get_num_threads()} threads, {args.new_tokens} new tokens, "
          f"median of {args.runs} runs; fast path matmul: {report['matmul']}")
    head = f"{'context':>8} {'stock':>8} {'engine':>8}" + "".join(f"{m:>11}" for m in modes[1:])
    print(head + f" {'speedup':>8}   (decode tokens/s)")
    for r in results:
        print(f"{r['context_tokens']:>8} {r['stock_tps']:>8.2f} {r['engine_tps']:>8.2f}"
              + "".join(f"{r[m + '_tps']:>11.2f}" for m in modes[1:]) + f" {r['speedup']:>7.1f}x")
    if e2e:
        print(f"end to end, {e2e['new_tokens']} tokens over {e2e['context_tokens']} tokens: naive "
              f"{e2e['naive']:.1f}s, TurboRAG {e2e['turbo']:.1f}s ({e2e['speedup']:.1f}x)"
              + (f", TurboRAG + int8 drafts {e2e['turbo_draft_int8']:.1f}s "
                 f"({e2e['speedup_draft_int8']:.1f}x)" if "turbo_draft_int8" in e2e else ""))
    for m, a in agreement.items():
        print(f"{m}: greedy answers identical to the engine's fp32 on {a['same']:.0%} of "
              f"{len(answers)} prompts (mean matching prefix {a['mean_matching_prefix']:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
