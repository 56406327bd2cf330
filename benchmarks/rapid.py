"""RAPID vs the long-context target alone vs naive speculative decoding.

Self-speculation (one model, SmolLM2 by default):

    python benchmarks/rapid.py --json                         # ≈7.6K-token context
    python benchmarks/rapid.py --context-tokens 2048 --new-tokens 32 --runs 1

A pair (a smaller drafter with the target's vocabulary):

    python benchmarks/rapid.py --target qwen2.5-coder-1.5b-instruct \
        --drafter qwen2.5-coder-0.5b-instruct --context-tokens 8192 --store /tmp/rapid-kv \
        --gamma 4 3 6 8 --drafter-quantize int8 none --drafter-tokens 1024 512 2048 4096 --json

All modes decode greedily over the same token ids (RAPID's prompt: chat template around the
long document and the question), after the target's prefill is in the prefix cache:
(a) the target alone, one token per forward; (b) naive speculative decoding: the drafter reads
the whole context; (c) RAPID: the drafter reads only the chunks retrieved for the question.
Self-speculation: the drafter is the target model itself (naive SD's cache a copy of the
target's), so RAPID's gain is the drafter's shorter context. Pair mode: see `pair_main`. Also
reports what a (γ + 1)-token verification forward costs in one-token steps, with the split
attention of core/attention.py and with stock SDPA.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.decode.loop import decode_loop, eos_token_ids
from turborag_integrations.core.decode.start import DecodeStart
from turborag_integrations.core.settings import GenerationConfig, SpeculationConfig
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


def timed_decode(model, pre, n, eos_ids=frozenset()):
    t0 = time.perf_counter()
    out = list(decode_loop(model, DecodeStart(pre.cache, pre.logits, pre.next_position),
                           GenerationConfig(max_new_tokens=n), eos_ids=set(eos_ids)))
    return out, time.perf_counter() - t0


def upto_eos(ids: list[int], engine) -> list[int]:
    """`ids` up to (without) the first end-of-sequence token."""
    eos = eos_token_ids(engine.model, engine.tokenizer)
    return ids[:next((k for k, t in enumerate(ids) if t in eos), len(ids))]


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
    ap.add_argument("--model", default=DEFAULT_MODEL, help="self-speculation: the one model")
    ap.add_argument("--target", help="pair mode: the target model (with --drafter)")
    ap.add_argument("--drafter", help="pair mode: the drafter model (same vocabulary)")
    ap.add_argument("--context-tokens", type=int, default=7600)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, nargs="+", default=[10],
                    help="drafts per round; pair mode: the first is the base setting, the "
                         "others are swept one at a time")
    ap.add_argument("--drafter-quantize", nargs="+", default=["none"],
                    choices=["none", "int8", "bf16"],
                    help="pair mode: the drafter's step weights (first: base setting)")
    ap.add_argument("--drafter-tokens", type=int, nargs="+", default=[1024],
                    help="pair mode: tokens of retrieved chunks the drafter reads (first: base)")
    ap.add_argument("--min-draft-prob", type=float, nargs="+", default=[0.0],
                    help="pair mode: adaptive draft length (first: base; 0: always γ)")
    ap.add_argument("--chunk-tokens", type=int, default=128,
                    help="pair mode: the drafter's chunk size (the reference code's 128)")
    ap.add_argument("--reference-context", action="store_true",
                    help="pair mode: also run RAPID with RapidEngine.reference's drafter context "
                         "(max(|C|/32, 4096) tokens)")
    ap.add_argument("--question", default=QUESTION, help="pair mode: the question")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="pair mode: decode exactly --new-tokens tokens past the end of the "
                         "answer (default: every mode stops where the target's answer ends)")
    ap.add_argument("--store", help="pair mode: KV store folder (keeps the one-off long-context "
                                    "prefills between invocations; default: a temporary one)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    if bool(args.target) != bool(args.drafter):
        ap.error("pair mode needs both --target and --drafter")
    if args.drafter:
        result = pair_main(args, log)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_pair(result)
        return 0
    args.gamma = args.gamma[0]

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
            for i, rnd in enumerate(speculate(target, drafter,
                                              dataclasses.replace(
                                                  config, max_new_tokens=args.new_tokens),
                                              SpeculationConfig(gamma=args.gamma))):
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
            # RAPID's call stops at the end of sequence; the target alone decoded past it
            lossless &= res.token_ids == upto_eos(ref, engine)
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


# ---- pair mode -------------------------------------------------------------------------------

def ensure_prefix(rapid: RapidEngine, engine, prefix: str, suffix: str, reserve: int) -> dict:
    """Put `engine`'s prefix KV in the store (the one-off long-context prefill, not timed)."""
    t0 = time.perf_counter()
    pre, key, hit = rapid.cached_prefill(engine, prefix, suffix, reserve)
    try:
        if not hit:
            ids = engine.tokenizer(prefix, add_special_tokens=False)["input_ids"]
            rapid.save_prefix(engine, key, pre.cache, ids)
    finally:
        engine.cache_pool.release(pre.cache)
    return {"hit": hit, "seconds": time.perf_counter() - t0, "tokens": len(pre.plan.token_ids)}


def spec_run(rapid: RapidEngine, t_pre, d_pre, setting: dict, n: int, eos_ids=()) -> dict:
    """Greedy speculative decoding of up to n tokens (to the end of sequence when `eos_ids` is
    given, as for the target alone) from two ready prefills; both caches are released."""
    target = Side(rapid.target.model, t_pre.cache, t_pre.logits, t_pre.next_position)
    drafter = Side(rapid.drafter.model, d_pre.cache, d_pre.logits, d_pre.next_position,
                   quantize=setting["quantize"])
    tokens, drafted, accepted, rounds, steps = [], 0, 0, 0, 0
    draft_s = verify_s = 0.0
    try:
        t_first = None
        for i, rnd in enumerate(speculate(target, drafter, GenerationConfig(max_new_tokens=n),
                                          SpeculationConfig(
                                              gamma=setting["gamma"],
                                              min_draft_prob=setting["min_draft_prob"]),
                                          eos_ids=eos_ids)):
            if i == 0:
                t_first = time.perf_counter()
            else:
                rounds += 1
                drafted += rnd.drafted
                accepted += rnd.accepted
                steps += rnd.draft_steps
                draft_s += rnd.draft_s
                verify_s += rnd.verify_s
            tokens += rnd.tokens
        secs = time.perf_counter() - t_first
    finally:
        rapid.target.cache_pool.release(t_pre.cache)
        rapid.drafter.cache_pool.release(d_pre.cache)
    return {"tokens": tokens, "tps": (len(tokens) - 1) / secs,
            "acceptance": accepted / max(drafted, 1), "mean_accepted": accepted / max(rounds, 1),
            "draft_step_ms": 1e3 * draft_s / max(steps, 1),
            "verify_ms": 1e3 * verify_s / max(rounds, 1),
            "draft_ms_per_round": 1e3 * draft_s / max(rounds, 1)}


def settings_to_run(args) -> list[dict]:
    """The base setting (the first value of every list), then each other value of one lever at
    a time, the rest at base."""
    quant = [None if q == "none" else q for q in args.drafter_quantize]
    base = {"gamma": args.gamma[0], "quantize": quant[0], "drafter_tokens": args.drafter_tokens[0],
            "min_draft_prob": args.min_draft_prob[0], "context": "budget"}
    out = [dict(base, lever="base")]
    for key, values in (("gamma", args.gamma), ("quantize", quant),
                        ("drafter_tokens", args.drafter_tokens),
                        ("min_draft_prob", args.min_draft_prob)):
        for v in values[1:]:
            if v != base[key]:
                out.append(dict(base, **{key: v}, lever=key))
    if args.reference_context:
        out.append(dict(base, context="reference", drafter_tokens=None, lever="reference"))
    return out


def label(s: dict) -> str:
    ctx = "reference" if s["context"] == "reference" else f"{s['drafter_tokens']} tok"
    extra = f", p≥{s['min_draft_prob']}" if s["min_draft_prob"] else ""
    return f"RAPID γ={s['gamma']} {s['quantize'] or 'fp32'} drafter, {ctx}{extra}"


def use_drafter_context(rapid: RapidEngine, setting: dict) -> None:
    """The drafter's retrieval budget: exactly `drafter_tokens` tokens of the best chunks
    (no threshold), or the reference code's max(|C| / 32, 4096)."""
    if setting["context"] == "reference":
        from turborag_integrations.core.rapid.engine import REFERENCE_CONTEXT

        rapid.config = rapid.config.with_settings(**REFERENCE_CONTEXT)
    else:
        rapid.config = rapid.config.with_settings(
            threshold=-1.0, compression=1.0, min_drafter_tokens=0,
            max_drafter_tokens=setting["drafter_tokens"])


def pair_main(args, log) -> dict:
    from turborag_integrations.core.rapid import RapidStats
    from turborag_integrations.core.decode.fast import FastDecoder

    med = statistics.median
    n = args.new_tokens
    tmp = None
    if args.store:
        store = KVStore(args.store)
    else:
        tmp = tempfile.TemporaryDirectory()
        store = KVStore(Path(tmp.name) / "kv")
    t0 = time.perf_counter()
    target = TurboRAGEngine(args.target, store=store, progress=False)
    drafter = TurboRAGEngine(args.drafter, store=store, progress=False)
    log(f"models loaded in {time.perf_counter() - t0:.0f}s")
    settings = settings_to_run(args)
    rapid = RapidEngine(target, drafter, gamma=args.gamma[0], chunk_tokens=args.chunk_tokens)
    doc = long_document(target.tokenizer, args.context_tokens)
    question = args.question
    eos = () if args.ignore_eos else eos_token_ids(target.model, target.tokenizer)
    prefix, suffix = rapid.render(target, doc, question)
    d_prefix, d_suffix = rapid.render(drafter, doc, question)
    reserve = n + max(args.gamma) + 2
    # One-off prefills, not timed: the target's long context (what RAPID reuses across
    # questions) and, for naive speculative decoding, the drafter's.
    cold_t = ensure_prefix(rapid, target, prefix, suffix, reserve)
    cold_d = ensure_prefix(rapid, drafter, d_prefix, d_suffix, reserve)
    log(f"prefix cache: target {cold_t}, drafter {cold_d}")
    for q in {s["quantize"] for s in settings} - {None}:
        FastDecoder.for_model(drafter.model, q)  # builds its reduced-precision copy once
    # The drafter's chunk blobs are encoded once, on first use (untimed warm-up calls).
    for s in settings:
        use_drafter_context(rapid, s)
        stats = RapidStats()
        pre = rapid.drafter_prefill(doc, question, None, stats, reserve)
        drafter.cache_pool.release(pre.cache)
        s["drafter_prompt_tokens"] = stats.drafter_prompt_tokens
        s["drafter_chunks"] = stats.drafter_chunks
    # What a verification forward costs against one step, on the target's long cache.
    pre, _, _ = rapid.target_prefill(prefix, suffix, reserve)
    verify = {g: verify_cost(target, pre, g) for g in sorted(set(args.gamma))}
    target.cache_pool.release(pre.cache)

    def target_alone():
        pre, _, _ = rapid.target_prefill(prefix, suffix, reserve)
        try:
            out, secs = timed_decode(target.model, pre, n, eos)
        finally:
            target.cache_pool.release(pre.cache)
        return out, (len(out) - 1) / secs

    base = settings[0]
    ref, target_tps, naive, per = None, [], [], {i: [] for i in range(len(settings))}
    lossless = {"target_repeat": True, "naive": True}
    for run in range(args.runs):
        # the target alone at both ends of each run: the machine's drift shows in its spread
        out, tps = target_alone()
        if ref is None:
            ref = out
        lossless["target_repeat"] &= out == ref
        target_tps.append(tps)
        t_pre, _, _ = rapid.target_prefill(prefix, suffix, reserve)
        d_pre, _, _ = rapid.cached_prefill(drafter, d_prefix, d_suffix, reserve)
        r = spec_run(rapid, t_pre, d_pre, base, n, eos)
        lossless["naive"] &= r["tokens"] == ref
        naive.append(r)
        log(f"run {run + 1}: target {tps:.3f} tok/s; naive SD {r['tps']:.3f} "
            f"(acceptance {r['acceptance']:.2f})")
        for i, s in enumerate(settings):
            use_drafter_context(rapid, s)
            t_pre, _, _ = rapid.target_prefill(prefix, suffix, reserve)
            try:
                d_pre = rapid.drafter_prefill(doc, question, None, RapidStats(), reserve)
            except BaseException:
                target.cache_pool.release(t_pre.cache)
                raise
            r = spec_run(rapid, t_pre, d_pre, s, n, eos)
            r["lossless"] = r.pop("tokens") == ref
            per[i].append(r)
            log(f"  {label(s)}: {r['tps']:.3f} tok/s, acceptance {r['acceptance']:.2f}, "
                f"draft step {r['draft_step_ms']:.0f} ms, verify {r['verify_ms']:.0f} ms, "
                f"identical {r['lossless']}")
        out, tps = target_alone()
        lossless["target_repeat"] &= out == ref
        target_tps.append(tps)
    t_med = med(target_tps)

    def summary(rs: list[dict]) -> dict:
        return {"tps": med(r["tps"] for r in rs), "ratio": med(r["tps"] for r in rs) / t_med,
                "acceptance": med(r["acceptance"] for r in rs),
                "mean_accepted": med(r["mean_accepted"] for r in rs),
                "draft_step_ms": med(r["draft_step_ms"] for r in rs),
                "verify_ms": med(r["verify_ms"] for r in rs),
                "tps_runs": [round(r["tps"], 4) for r in rs]}

    naive_sum = summary(naive)
    naive_sum.update(lossless=lossless["naive"], drafter_tokens=cold_d["tokens"],
                     gamma=base["gamma"], quantize=base["quantize"])
    rows = []
    for i, s in enumerate(settings):
        row = {k: v for k, v in s.items()}
        row.update(summary(per[i]), lossless=all(r["lossless"] for r in per[i]),
                   label=label(s))
        rows.append(row)
    # The answer: up to the end of sequence (with --ignore-eos the timed decodes run past it).
    answer_ids = upto_eos(ref, target)
    step_ms = 1e3 / t_med
    result = {
        "mode": "pair", "target": args.target, "drafter": args.drafter,
        "context_tokens": cold_t["tokens"], "new_tokens": n, "runs": args.runs,
        "question": question, "ignore_eos": args.ignore_eos, "decoded_tokens": len(ref),
        "threads": torch.get_num_threads(), "chunk_tokens": args.chunk_tokens,
        "cold_target_prefill_s": None if cold_t["hit"] else cold_t["seconds"],
        "cold_drafter_prefill_s": None if cold_d["hit"] else cold_d["seconds"],
        "target_tps": t_med, "target_tps_runs": [round(t, 4) for t in target_tps],
        "target_step_ms": step_ms, "target_repeatable": lossless["target_repeat"],
        "verify_in_steps": {g: {"split": v["split"] / v["step"], "stock": v["stock"] / v["step"],
                                "step_ms": 1e3 * v["step"]} for g, v in verify.items()},
        "naive_sd": naive_sum, "rapid": rows,
        "answer": target.tokenizer.decode(answer_ids, skip_special_tokens=True),
        "answer_tokens": len(answer_ids),
    }
    if tmp is not None:
        store.close()
        tmp.cleanup()
    return result


def print_pair(r: dict) -> None:
    print(f"{r['target']} ← {r['drafter']}: {r['context_tokens']} context tokens, "
          f"{r['decoded_tokens']} tokens decoded (at most {r['new_tokens']}"
          f"{', past the end of the answer' if r['ignore_eos'] else ''}), {r['runs']} runs, "
          f"{r['threads']} threads")
    print(f"target alone: {r['target_tps']:.3f} tok/s ({r['target_step_ms']:.0f} ms/step), "
          f"runs {r['target_tps_runs']}")
    for g, v in r["verify_in_steps"].items():
        print(f"verify γ+1={g + 1} tokens: {v['split']:.2f} steps (split), "
              f"{v['stock']:.2f} (stock SDPA)")
    head = f"{'mode':<48} {'drafter tok':>11} {'tok/s':>7} {'ratio':>6} {'accept':>6} " \
           f"{'acc/rnd':>7} {'draft ms':>8} {'verify ms':>9} {'= greedy':>8}"
    print(head)
    print(f"{'target alone':<48} {'':>11} {r['target_tps']:7.3f} {1.0:6.2f}")
    nv = r["naive_sd"]
    print(f"{'naive SD γ=%d %s drafter, full context' % (nv['gamma'], nv['quantize'] or 'fp32'):<48}"
          f" {nv['drafter_tokens']:>11} {nv['tps']:7.3f} {nv['ratio']:6.2f} "
          f"{nv['acceptance']:6.2f} {nv['mean_accepted']:7.2f} {nv['draft_step_ms']:8.0f} "
          f"{nv['verify_ms']:9.0f} {str(nv['lossless']):>8}")
    for row in r["rapid"]:
        print(f"{row['label']:<48} {row['drafter_prompt_tokens']:>11} {row['tps']:7.3f} "
              f"{row['ratio']:6.2f} {row['acceptance']:6.2f} {row['mean_accepted']:7.2f} "
              f"{row['draft_step_ms']:8.0f} {row['verify_ms']:9.0f} {str(row['lossless']):>8}")
    print(f"answer ({r['answer_tokens']} tokens): {r['answer']!r}")

if __name__ == "__main__":
    sys.exit(main())
