"""RAPID vs the long-context target alone vs naive speculative decoding, on SmolLM2.

    python benchmarks/rapid.py --json                         # ≈7.6K-token context
    python benchmarks/rapid.py --context-tokens 2048 --new-tokens 32 --runs 1

All three decode greedily over the same token ids (RAPID's prompt: chat template around the
long document and the question), after the target's prefill is in the prefix cache:
(a) the target alone, one token per forward; (b) naive speculative decoding: the same model as
drafter, reading the whole context (its cache a copy of the target's); (c) RAPID: the drafter
reads only the chunks retrieved for the question (≤ min(4096, |C|/λ) tokens). Self-speculation
throughout: one model, so RAPID's gain is the drafter's shorter context. Also reports what a
(γ + 1)-token verification forward costs in one-token steps, with the split attention of
core/attention.py and with stock SDPA.
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

import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.decode.loop import decode_loop
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.models import DEFAULT_MODEL
from turborag_integrations.core.rapid import RapidEngine, Side, speculate
from turborag_integrations.core.store import KVStore

SAMPLE_DOCS = Path(__file__).resolve().parents[1] / "turborag_integrations" / "data" / "sample_docs"
NEEDLE = "The keeper of the harbour archive in volume {k} is a clockmaker named Odile Marchetti."
QUESTION = "Who is the keeper of the harbour archive, and what is her trade?"


def long_document(tokenizer, tokens: int, seed: int = 0) -> str:
    """The sample documents, paragraphs shuffled per volume, until ≈`tokens` tokens; one
    volume holds the needle fact the question asks about."""
    rng = random.Random(seed)
    paragraphs = [p.strip() for f in sorted(SAMPLE_DOCS.glob("*.md"))
                  for p in f.read_text().split("\n\n") if p.strip() and not p.startswith("#")]
    parts, used, k = [], 0, 0
    while used < tokens:
        k += 1
        body = paragraphs[:]
        rng.shuffle(body)
        if k == 3:
            body.insert(len(body) // 2, NEEDLE.format(k=k))
        volume = f"Archive volume {k}.\n\n" + "\n\n".join(body)
        n = len(tokenizer(volume, add_special_tokens=False)["input_ids"])
        if used + n > tokens:
            ids = tokenizer(volume, add_special_tokens=False)["input_ids"][: tokens - used]
            volume = tokenizer.decode(ids).rsplit("\n\n", 1)[0]
        parts.append(volume)
        used += n
    return "\n\n".join(parts)


def timed_decode(model, pre, n):
    t0 = time.perf_counter()
    out = list(decode_loop(model, pre.cache, pre.logits, pre.next_position,
                           GenerationConfig(max_new_tokens=n), eos_ids=set()))
    return out, time.perf_counter() - t0


def verify_cost(engine, pre, gamma, reps=3):
    """Seconds of a 1-token step and of a (γ+1)-token forward, split and stock."""
    side = Side(engine.model, pre.cache, pre.logits, pre.next_position)
    base = pre.cache.length
    res = {}
    for name, k, split in (("step", 1, False), ("split", gamma + 1, True),
                           ("stock", gamma + 1, False)):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            side.feed([100] * k, keep=k, verify=split)
            times.append(time.perf_counter() - t0)
            side.truncate(base)
        res[name] = statistics.median(times)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--context-tokens", type=int, default=7600)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=10)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    with tempfile.TemporaryDirectory() as tmp:
        engine = TurboRAGEngine(args.model, store=KVStore(Path(tmp) / "kv"), progress=False)
        rapid = RapidEngine(engine, gamma=args.gamma)
        doc = long_document(engine.tokenizer, args.context_tokens)
        prefix, suffix = rapid.render(engine, doc, QUESTION)
        config = GenerationConfig(max_new_tokens=args.new_tokens)
        # Cold RAPID call: fills the prefix cache (target prefill) and the chunk blobs.
        cold = rapid.generate(doc, QUESTION, config=config)
        log(f"cold call: target prefill {cold.stats.target_prefill_s:.1f}s, drafter prefill "
            f"{cold.stats.drafter_prefill_s:.2f}s, retrieval {cold.stats.retrieval_s:.2f}s")
        context_tokens = cold.stats.target_prompt_tokens
        target_tps, naive_tps, rapid_tps, naive_acc, rapid_acc = [], [], [], [], []
        lossless = True
        verify = None
        for _ in range(args.runs):
            # (a) target alone
            reserve = args.new_tokens + args.gamma + 2
            pre, _, _ = rapid.target_prefill(prefix, suffix, reserve)
            ref, secs = timed_decode(engine.model, pre, args.new_tokens)
            target_tps.append((len(ref) - 1) / secs)
            engine.cache_pool.release(pre.cache)
            pre, _, _ = rapid.target_prefill(prefix, suffix, reserve)
            if verify is None:
                verify = verify_cost(engine, pre, args.gamma)
            # (b) naive speculative decoding: the drafter reads the whole context too
            pre_d = pre.cache.clone()
            drafter = Side(engine.model, pre_d, pre.logits, pre.next_position)
            target = Side(engine.model, pre.cache, pre.logits, pre.next_position)
            t0 = time.perf_counter()
            toks, drafted, accepted = [], 0, 0
            for i, rnd in enumerate(speculate(target, drafter, config, gamma=args.gamma,
                                              max_new_tokens=args.new_tokens)):
                if i == 0:
                    t_first = time.perf_counter()
                toks += rnd.tokens
                drafted += rnd.drafted
                accepted += rnd.accepted
            naive_tps.append((len(toks) - 1) / (time.perf_counter() - t_first))
            naive_acc.append(accepted / max(drafted, 1))
            lossless &= toks == ref
            engine.cache_pool.release(pre.cache)
            # (c) RAPID (prefix cache warm)
            res = rapid.generate(doc, QUESTION, config=config)
            rapid_tps.append(res.stats.decode_tokens_per_s)
            rapid_acc.append(res.stats.acceptance_rate)
            lossless &= res.token_ids == ref
            log(f"run: target {target_tps[-1]:.2f} tok/s, naive SD {naive_tps[-1]:.2f} "
                f"(acc {naive_acc[-1]:.2f}), RAPID {rapid_tps[-1]:.2f} (acc {rapid_acc[-1]:.2f}, "
                f"drafter {res.stats.drafter_prompt_tokens} tokens)")
        med = statistics.median
        result = {
            "model": args.model, "context_tokens": context_tokens, "new_tokens": args.new_tokens,
            "gamma": args.gamma, "runs": args.runs, "threads": torch.get_num_threads(),
            "target_tps": med(target_tps), "naive_sd_tps": med(naive_tps),
            "rapid_tps": med(rapid_tps), "rapid_speedup": med(rapid_tps) / med(target_tps),
            "naive_sd_speedup": med(naive_tps) / med(target_tps),
            "rapid_acceptance": med(rapid_acc), "naive_sd_acceptance": med(naive_acc),
            "lossless_greedy": lossless,
            "drafter_tokens": res.stats.drafter_prompt_tokens,
            "drafter_chunks": res.stats.drafter_chunks,
            "cold_target_prefill_s": cold.stats.target_prefill_s,
            "warm_target_prefill_s": res.stats.target_prefill_s,
            "rapid_ttft_s": res.stats.ttft_s,
            "verify_step_s": verify["step"],
            "verify_split_in_steps": verify["split"] / verify["step"],
            "verify_stock_in_steps": verify["stock"] / verify["step"],
            "answer": res.text,
        }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
