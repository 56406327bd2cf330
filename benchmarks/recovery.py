"""The recovery frontier on the stock pipelines' own prompts: every recovery answers the same
prompts, from the same stored blobs, next to the unmodified model's full prefill.

    # 1. the pipelines' prompts (and the full prefill's greedy replies), captured once
    python benchmarks/recovery.py capture turborag_integrations/data/handdev/handdev.jsonl dev.jsonl
    # 2. the shared corpus's blobs with the encoding under test (context encoding, lead blobs
    #    for the LlamaIndex head; --engine-arg context_tokens=0 for chunks encoded alone)
    python benchmarks/recovery.py ingest turborag_integrations/data/handdev/handdev.jsonl --store kv/
    # 3. greedy replies of each recovery: right, the same reply as the full prefill, TTFT
    python benchmarks/recovery.py answer dev.jsonl --store kv/ --lead \\
        --recovery none --recovery select:0.15 --recovery select:0.3
    # or teacher-forced: the reply KL and top-1 agreement with the full prefill
    python benchmarks/recovery.py kl dev.jsonl --store kv/ --recovery none --recovery random:0.2

Prompts are text, so one capture serves every encoding: `answer` and `kl` stitch each captured
prompt's retrieved chunks from --store, which `ingest` fills as the LlamaIndex pipeline does
(linked nodes, so each chunk is encoded after its document's text before it; --lead registers
the stock query engine's head, as `TurboRAGLLM` does, so the prompts' first chunks use their
lead blobs). A chunk missing from the store is encoded alone at query time, which is not what
is being measured: ingest first. `random:R` (recompute a random R of the chunk tokens) is a
control, not a recovery the package offers. Prints a table; --json prints one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _pipelines():
    """benchmarks/pipelines.py: its pipelines, corpus and judge are the ones measured here."""
    spec = importlib.util.spec_from_file_location("bench_pipelines", REPO / "benchmarks" /
                                                  "pipelines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def engine_args(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        out[key] = (int(value) if value.isdigit() else None if value == "none"
                    else value)
    return out


def make_engine(args, **defaults):
    from turborag_integrations.core.engine import TurboRAGEngine

    return TurboRAGEngine(args.model, store=args.store, progress=False,
                          **{**defaults, **engine_args(args.engine_arg)})


def capture(args) -> int:
    """Answer each item through the pipelines with a full prefill; keep each prompt as the LLM
    received it, the retrieved chunks in it, and the greedy reply."""
    bp = _pipelines()
    items, _ = bp.load_jsonl(Path(args.data))
    corpus, sources = bp.shared_corpus(items), bp.corpus_sources(items)
    items = items[:args.limit] if args.limit else items
    engine = make_engine(args, context_tokens=0)  # prompts do not depend on the encoding
    work = Path(tempfile.mkdtemp())
    classes = {"llama_index": bp.LlamaIndexPipeline, "langchain": bp.LangChainPipeline,
               "langchain_system": bp.LangChainSystemPipeline}
    runners = [classes[p](engine, work, args.max_new_tokens, "score", False)
               for p in args.pipelines.split(",")]
    for runner in runners:
        runner.prepare(corpus, collection="corpus", k=args.k, sources=sources)
    seen = {}
    stream = engine.stream

    def keep(prompt, **kwargs):
        seen["prompt"] = prompt
        return stream(prompt, **kwargs)
    engine.stream = keep
    with open(args.out, "w") as out:
        for i, item in enumerate(items):
            for runner in runners:
                reply, _, retrieved = runner.answer(item["question"], "naive")
                prompt = seen["prompt"]
                correct, _ = bp.judge(reply.strip(), item)
                out.write(json.dumps({
                    "id": item["id"], "pipeline": runner.name, "prompt": prompt,
                    "chunks": [c for c in retrieved if c in prompt], "reply": reply.strip(),
                    "answers": item["answers"], "unanswerable": item["unanswerable"],
                    "correct": correct}) + "\n")
                out.flush()
                print(f"[{i + 1}/{len(items)}] {runner.name} {'ok ' if correct else 'bad'} "
                      f"{reply[:60]!r}", file=sys.stderr, flush=True)
    return 0


def ingest(args) -> int:
    """Fill --store with the corpus's blobs as the LlamaIndex pipeline ingests them."""
    bp = _pipelines()
    items, _ = bp.load_jsonl(Path(args.data))
    corpus, sources = bp.shared_corpus(items), bp.corpus_sources(items)
    engine = make_engine(args)
    start = time.perf_counter()
    runner = bp.LlamaIndexPipeline(engine, Path(tempfile.mkdtemp()), 8, "score",
                                   not args.no_lead)
    runner.prepare(corpus, collection="corpus", k=6, sources=sources)
    print(json.dumps({"chunks": len(corpus), "ingest_s": time.perf_counter() - start,
                      "engine_args": engine_args(args.engine_arg),
                      "lead_blobs": not args.no_lead}))
    return 0


class RandomRecompute:
    """A control: recompute a random share of the chunk tokens (seeded, so runs compare)."""

    def __new__(cls, ratio: float):
        from turborag_integrations.core.prefill.recovery import Recovery, _chunk_spans

        class Random(Recovery):
            def select(self, model, plan, rotator, pool=None):
                index = [i for span in _chunk_spans(plan)
                         for i in range(span.prompt_start, span.prompt_start + span.blob.num_tokens)]
                return sorted(random.Random(0).sample(index, math.ceil(ratio * len(index))))

            def __str__(self):
                return f"random:{ratio:g}"
        return Random()


def recovery_of(spec: str):
    from turborag_integrations.core.prefill.recovery import parse_recovery

    if spec.startswith("random:"):
        return RandomRecompute(float(spec.partition(":")[2]))
    return parse_recovery(spec)


def load_rows(args) -> list[dict]:
    rows = [json.loads(line) for line in open(args.captured)]
    if args.pipelines:
        rows = [r for r in rows if r["pipeline"] in args.pipelines.split(",")]
    return rows[:args.limit] if args.limit else rows


def judged(reply: str, row: dict) -> bool:
    from turborag_integrations.evaluation.metrics import is_refusal, score

    if row["unanswerable"]:
        return is_refusal(reply)
    return bool(score(reply, row["answers"])["contains"])


def answer(args) -> dict:
    """Greedy replies of each recovery: right, same as the full prefill's, TTFT."""
    from turborag_integrations.core.settings import GenerationConfig
    from turborag_integrations.evaluation.metrics import normalize

    engine = make_engine(args)
    if args.lead:
        from turborag_integrations.llama_index import TurboRAGLLM

        TurboRAGLLM(engine)  # registers the stock query engine's head, as in the pipeline
    rows = load_rows(args)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=0.0,
                              stop=["\n\n"])
    specs = list(dict.fromkeys(args.recovery))
    results = {s: {"right": 0, "same": 0, "agree": 0, "ttft": [], "recomputed": []}
               for s in specs}
    full_right = 0
    for i, row in enumerate(rows):
        full_right += row["correct"]
        for spec in specs:
            res = engine.generate(row["prompt"], chunks=row["chunks"], config=config,
                                  recovery=recovery_of(spec))
            reply, stats = res.text.strip(), res.stats
            right = judged(reply, row)
            r = results[spec]
            r["right"] += right
            r["same"] += normalize(reply) == normalize(row["reply"])
            r["agree"] += right == row["correct"]
            r["ttft"].append(stats.ttft_s)
            recomputed = stats.extra.get("recomputed_tokens", 0)
            r["recomputed"].append(recomputed / max(1, stats.reused_tokens + recomputed))
        print(f"[{i + 1}/{len(rows)}] {row['id']} {row['pipeline']}", file=sys.stderr,
              flush=True)
    return {"prompts": len(rows), "full_prefill_right": full_right, "results": [
        {"recovery": s, "right": r["right"], "same_reply_pct": 100 * r["same"] / len(rows),
         "correct_agreement_pct": 100 * r["agree"] / len(rows),
         "median_ttft_s": statistics.median(r["ttft"]),
         "mean_recomputed_share": statistics.mean(r["recomputed"])}
        for s, r in results.items()]}


def kl(args) -> dict:
    """Teacher-forced: each recovery's next-token distributions along the full prefill's own
    reply, against the full prefill's (mean KL, top-1 agreement)."""
    from turborag_integrations.evaluation.agreement import reply_logits, token_agreement

    engine = make_engine(args)
    rows = load_rows(args)
    specs = list(dict.fromkeys(args.recovery))
    results = {s: {"kl": [], "top1": []} for s in specs}
    for i, row in enumerate(rows):
        ids = engine.tokenizer(row["reply"], add_special_tokens=False)["input_ids"][:32]
        if not ids:
            continue
        reference = reply_logits(engine, row["prompt"], ids, mode="naive")
        for spec in specs:
            got = reply_logits(engine, row["prompt"], ids, chunks=row["chunks"], mode="turbo",
                               recovery=recovery_of(spec))
            kl_, top1 = token_agreement(reference, got)
            results[spec]["kl"].append(kl_)
            results[spec]["top1"].append(top1)
        print(f"[{i + 1}/{len(rows)}] {row['id']} {row['pipeline']}", file=sys.stderr,
              flush=True)
    return {"prompts": len(rows), "results": [
        {"recovery": s, "mean_kl": statistics.mean(r["kl"]),
         "top1_pct": statistics.mean(r["top1"])} for s, r in results.items()]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", default=None, help="bundled name, folder or HF id")
    common.add_argument("--store", default=None, help="KV store folder")
    common.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="TurboRAGEngine keyword, e.g. context_tokens=0, encoder=none")
    common.add_argument("--pipelines", default="llama_index,langchain_system")
    common.add_argument("--limit", type=int, default=None)
    common.add_argument("--max-new-tokens", type=int, default=48)
    p = sub.add_parser("capture", parents=[common], help="capture the pipelines' prompts")
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--k", type=int, default=6)
    p = sub.add_parser("ingest", parents=[common], help="fill --store with the corpus's blobs")
    p.add_argument("data")
    p.add_argument("--no-lead", action="store_true", help="no lead blobs for the stock head")
    for name in ("answer", "kl"):
        p = sub.add_parser(name, parents=[common], help=f"{name} each recovery")
        p.add_argument("captured")
        p.add_argument("--recovery", action="append", required=True, metavar="SPEC",
                       help="repeatable: none, select:R, select:auto, boundary:K, blend:R, "
                            "random:R (a control)")
        p.add_argument("--lead", action="store_true",
                       help="use the stock LlamaIndex head's lead blobs (as TurboRAGLLM does)")
        p.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.command == "capture":
        return capture(args)
    if args.command == "ingest":
        return ingest(args)
    for spec in args.recovery:
        try:
            recovery_of(spec)
        except ValueError as exc:
            ap.error(f"--recovery: {exc}")
    report = (answer if args.command == "answer" else kl)(args)
    report.update(command=args.command, model=args.model, store=args.store,
                  engine_args=engine_args(args.engine_arg), lead=args.lead)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['prompts']} prompts" + (f"; full prefill right {report['full_prefill_right']}"
                                            if "full_prefill_right" in report else ""))
    for r in report["results"]:
        print("  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
