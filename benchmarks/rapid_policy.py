"""RAPID's policy against the target alone, per context length: does `policy="auto"` keep
RAPID's speed where speculation pays and fall back where it does not?

    python benchmarks/rapid_policy.py                               # SmolLM2 self, 1K–8K
    python benchmarks/rapid_policy.py --target qwen2.5-coder-1.5b-instruct \
        --drafter qwen2.5-coder-0.5b-instruct --lengths 2048 8192 --json

Per context length (the sample documents with a needle fact, as benchmarks/rapid.py builds
them), interleaved over `--runs` rounds: the target alone (`engine.generate(mode="naive")` over
RAPID's own prompt and token ids), RAPID with `policy="auto"` and with `policy="always"` (fixed
γ), each greedy to `--new-tokens` with the end-of-sequence token ignored (so every run decodes as
many tokens; answers are compared up to it), after the target's prefill is cached. Decode tokens/s are medians; a speed-up is the
median over the rounds of each run's speed over the target alone's in the same round. The auto policy learns per context length as an
engine would: its first run at a length pays for its probe, the next ones decide at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rapid import QUESTION, long_document  # noqa: E402

from turborag_integrations.core.engine import TurboRAGEngine  # noqa: E402
from turborag_integrations.core.rapid import RapidEngine  # noqa: E402
from turborag_integrations.core.prefill.stitch import Segment  # noqa: E402
from turborag_integrations.core.settings import GenerationConfig  # noqa: E402


def answer(ids: list[int], eos: set[int]) -> list[int]:
    """The answer a user reads: the tokens before the first end of sequence (the runs decode
    past it, so that each does the same work)."""
    return ids[:next((i for i, t in enumerate(ids) if t in eos), len(ids))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="self-speculation: the one model")
    ap.add_argument("--target")
    ap.add_argument("--drafter")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=10)
    ap.add_argument("--drafter-quantize", choices=["int8", "bf16"], default=None,
                    help="the drafter's steps on reduced-precision weights")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    target = TurboRAGEngine(args.target or args.model, progress=False)
    drafter = (TurboRAGEngine(args.drafter, store=target.store, progress=False)
               if args.drafter else target)
    settings = dict(gamma=args.gamma, drafter_quantize=args.drafter_quantize)
    auto = RapidEngine(target, drafter, policy="auto", **settings)
    always = RapidEngine(target, drafter, policy="always", **settings)
    config = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True)
    eos = set(target.eos_ids)
    rows = []
    for length in args.lengths:
        context = long_document(target.tokenizer, length)
        prefix, suffix = auto.render(target, context, QUESTION)
        speeds: dict[str, list[float]] = {"alone": [], "auto": [], "always": []}
        answers, policies = {}, []
        always.generate(context, QUESTION, config=config)  # caches the target's prefill
        for _ in range(args.runs):
            # RAPID's own token ids (prefix and suffix tokenized apart), the prefix's KV from
            # the prefix cache RAPID filled (the same key), then the target's own decode loop
            alone = target.generate([Segment(prefix, target.library.prefix_blob(prefix)),
                                     Segment(suffix)], config=config, recovery="none")
            speeds["alone"].append(alone.stats.decode_tokens_per_s)
            answers["alone"] = alone.token_ids
            for name, rapid in (("auto", auto), ("always", always)):
                result = rapid.generate(context, QUESTION, config=config)
                speeds[name].append(result.stats.decode_tokens_per_s)
                answers[name] = result.token_ids
                if name == "auto":
                    policies.append(result.stats.policy)
        med = {k: statistics.median(v) for k, v in speeds.items()}
        # each run against the target alone of the same round (interleaved), then the median
        ratios = {k: [s / a for s, a in zip(speeds[k], speeds["alone"])]
                  for k in ("auto", "always")}
        rows.append({"context_tokens": length, "tokens_per_s": med,
                     "auto_speedup": statistics.median(ratios["auto"]),
                     "always_speedup": statistics.median(ratios["always"]),
                     "auto_runs": ratios["auto"], "always_runs": ratios["always"],
                     "same_answers": len({tuple(answer(a, eos)) for a in answers.values()}) == 1,
                     "policy_last": policies[-1]})
    result = {"target": target.loaded.name, "drafter": drafter.loaded.name,
              "gamma": args.gamma, "drafter_quantize": args.drafter_quantize, "new_tokens": args.new_tokens, "runs": args.runs,
              "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['target']} ← {result['drafter']}, γ ≤ {args.gamma}, {args.new_tokens} "
          f"tokens, medians of {args.runs}")
    print(f"{'context':>8} {'alone tok/s':>12} {'auto':>8} {'always':>8} {'auto γ':>7} "
          f"{'off':>5} {'same':>5}")
    for r in rows:
        p = r["policy_last"]
        print(f"{r['context_tokens']:>8} {r['tokens_per_s']['alone']:>12.1f} "
              f"{r['auto_speedup']:>7.2f}x {r['always_speedup']:>7.2f}x {p['mean_gamma']:>7.1f} "
              f"{str(p['switched_off']):>5} {str(r['same_answers']):>5}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
