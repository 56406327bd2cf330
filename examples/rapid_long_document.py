"""Questions over one long document with RAPID, against the long-context target alone.

    python examples/rapid_long_document.py                  # ≈6K-token document, SmolLM2
    python examples/rapid_long_document.py --tokens 3000 --new-tokens 48

The target (SmolLM2) reads the whole document; the drafter (the same model) reads only the
chunks retrieved for each question. The first question pays the target's full prefill, which
is then kept as a prefix cache: later questions prefill only the question.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rapid import long_document  # noqa: E402
from turborag_integrations.core.engine import TurboRAGEngine  # noqa: E402
from turborag_integrations.core.settings import GenerationConfig  # noqa: E402
from turborag_integrations.core.rapid import RapidEngine, target_greedy  # noqa: E402

QUESTIONS = [
    "Who is the keeper of the harbour archive, and what is her trade?",
    "What is the Ember-7 tile made of, and how much heat can it take?",
    "Why does the Velmora ferry stop running in winter?",
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=10)
    ap.add_argument("--no-baseline", action="store_true", help="skip the target-alone run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = TurboRAGEngine(store=Path(tmp) / "kv", progress=False)
        rapid = RapidEngine(engine, gamma=args.gamma)
        doc = long_document(engine.tokenizer, args.tokens)
        config = GenerationConfig(max_new_tokens=args.new_tokens)
        for question in QUESTIONS:
            result = rapid.generate(doc, question, config=config)
            s = result.stats
            print(f"\nQ: {question}\nA: {result.text.strip()}")
            print(f"   target prefill {s.target_prefill_s:.1f}s "
                  f"({'prefix cache hit' if s.target_prefix_hit else 'cold'}), drafter "
                  f"{s.drafter_prompt_tokens} tokens from {s.drafter_chunks} chunks, "
                  f"acceptance {s.acceptance_rate:.0%} ({s.mean_accepted:.1f}/round), "
                  f"RAPID {s.decode_tokens_per_s:.2f} tok/s")
            if not args.no_baseline:
                prefix, suffix = rapid.render(engine, doc, question)
                t0 = time.perf_counter()
                ids = target_greedy(engine, prefix, suffix, args.new_tokens)
                secs = time.perf_counter() - t0
                print(f"   target alone (prefix cached): {len(ids) / secs:.2f} tok/s, "
                      f"same answer: {ids == result.token_ids}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
