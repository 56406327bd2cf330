"""A hot set against encoding everything: a trace-driven simulator fed with costs measured here.

    python benchmarks/hotset.py                      # calibrate, then 100K and 1M chunks
    python benchmarks/hotset.py --corpus 100000 --skew 0.9 --json
    python benchmarks/hotset.py --validate 2000      # the simulator against the real engine

Calibration (this machine, the engine as a user runs it, memory tier off so blobs come from
disk): TTFT of a prompt of `--k` retrieved chunks of `--chunk-tokens` tokens with m of them
without a blob, for m = 0..k (medians of 3; m = k is the turbo path prefilling everything),
beside a full prefill; the encoding time and the stored bytes of one chunk.

Simulation: a corpus of N chunks whose popularity follows Zipf(skew); each query retrieves k
distinct chunks. Policies:

- `everything`: every chunk encoded at ingestion (N encodes, N blobs; every retrieval a hit);
- `hot:B`: the hot set (core/admission.py, `admit_after=2`, `admission_tracked` = the chunks
  the budget holds) in a store of B% of the corpus bytes: retrievals counted with the engine's
  ageing (counts halved past `admission_tracked` chunks), a chunk encoded on its 2nd retrieval,
  the store evicting the coldest by the disk tier's heat, (reads + 1) · 0.5^(idle / half-life),
  down to 90% of its budget (core/store/eviction.py);
- `first:B`: store on first use with LRU eviction (LMCache's policy) in the same budget.

A query's TTFT is the calibrated TTFT for its number of chunks without a blob. Reported over
the second half of the trace (the hot set has warmed up): chunk hit rate, mean and p99 TTFT, the
share of `everything`'s mean TTFT gain over a full prefill, encodes (ingestion compute) as a
share of N, and store bytes. An admitted chunk is taken to be stored by the next query (the
table gives the encodes per query the background encoder must keep up with).

`--validate N` runs the real engine with `admit_after=2` and a disk budget over N synthetic
chunks and a Zipf trace, and the simulator on the same trace with the same costs: hit rate,
encodes, and mean TTFT as a share of the full prefill's (timed per query in the same run: the
machine's speed drifts between the calibration and the run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

BUDGETS = (1, 5, 10, 25)
TRACKED = 100_000  # the engine's counting window before a blob's size is known
LOW_WATER = 0.9  # core/store/eviction.py


# ---- calibration ---------------------------------------------------------------------------
def calibrate(model: str, k: int, chunk_tokens: int, runs: int = 3) -> dict:
    """TTFT with m of k chunks missing (m = 0..k), the full prefill's, encode seconds and
    bytes a chunk, measured on this machine."""
    from ttft import make_chunks

    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.prompt_template import render_chat
    from turborag_integrations.core.settings import GenerationConfig
    from turborag_integrations.core.store import KVStore

    one = GenerationConfig(max_new_tokens=1)
    with tempfile.TemporaryDirectory() as tmp:
        engine = TurboRAGEngine(model, store=KVStore(tmp, memory_bytes=0), progress=False)
        engine.warmup()
        pool = make_chunks(engine.tokenizer, 2 * k + 2, chunk_tokens)
        t0 = time.perf_counter()
        engine.encode_chunks(pool[:k])
        encode_s = (time.perf_counter() - t0) / k
        blob_bytes = engine.store.stats().bytes_written / k
        ttft = {m: [] for m in range(k + 1)}
        full = []
        for run in range(runs + 1):  # the first round warms up
            for m in range(k + 1):
                # the first k − m chunks have blobs, the m after them none
                chunks = pool[:k - m] + pool[k + 1:k + 1 + m]
                prompt = render_chat(engine.tokenizer, [
                    {"role": "system", "content": "Answer using only the documents."},
                    {"role": "user", "content": "Documents:\n\n" + "\n\n".join(chunks)
                     + "\n\nQuestion: which lighthouse is the tallest?"}])
                stats = engine.generate(prompt, chunks=chunks, config=one).stats
                assert stats.cache_misses == m, (m, stats.cache_misses)
                if run:
                    ttft[m].append(stats.ttft_s)
                if m == k and run:
                    full.append(engine.generate(prompt, config=one, mode="naive").stats.ttft_s)
        engine.close()
    return {"model": model, "k": k, "chunk_tokens": chunk_tokens, "encode_s": encode_s,
            "blob_bytes": blob_bytes, "full_s": statistics.median(full),
            "ttft_s": [statistics.median(ttft[m]) for m in range(k + 1)], "runs": runs}


# ---- traces --------------------------------------------------------------------------------
def zipf_trace(n: int, skew: float, queries: int, k: int, seed: int = 0) -> list[list[int]]:
    """`queries` lists of k distinct chunk ids in [0, n), chunk i drawn with weight
    1 / (i + 1)^skew."""
    rng = np.random.default_rng(seed)
    cdf = np.cumsum(1.0 / np.arange(1, n + 1) ** skew)
    cdf /= cdf[-1]
    out = []
    draws = np.searchsorted(cdf, rng.random((queries, 4 * k)))
    for row in draws.tolist():
        picked = list(dict.fromkeys(row))[:k]
        out.append(picked)
    return out


# ---- policies ------------------------------------------------------------------------------
class Everything:
    name = "everything"

    def __init__(self, n: int):
        self.encodes = n
        self.stored = n

    def query(self, ids: list[int], t: int) -> int:
        return 0


class FirstUse:
    """Store on first use, least recently used out (LMCache)."""

    def __init__(self, capacity: int):
        self.name = "first"
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.encodes = 0

    def query(self, ids: list[int], t: int) -> int:
        missing = 0
        for i in ids:
            if i in self.lru:
                self.lru.move_to_end(i)
                continue
            missing += 1
            self.lru[i] = None
            self.encodes += 1
            if len(self.lru) > self.capacity:
                self.lru.popitem(last=False)
        return missing

    @property
    def stored(self) -> int:
        return len(self.lru)


class HotSet:
    """The engine's admission (count, age, admit on the `after`-th retrieval) over the disk
    tier's eviction (heat, down to the low-water mark)."""

    def __init__(self, n: int, capacity: int, after: int = 2, half_life: float = 1e4,
                 tracked: int = TRACKED):
        self.name = "hot"
        self.capacity, self.after, self.half_life, self.tracked = capacity, after, half_life, tracked
        self.counts: dict[int, int] = {}
        self.stored_set: set[int] = set()
        self.reads = np.zeros(n, dtype=np.int64)
        self.last = np.zeros(n, dtype=np.float64)
        self.encodes = 0

    def query(self, ids: list[int], t: int) -> int:
        missing = 0
        admit = []
        for i in ids:
            c = self.counts.get(i, 0) + 1
            self.counts[i] = c
            if i in self.stored_set:
                self.reads[i] += 1
                self.last[i] = t
                continue
            missing += 1
            if c >= self.after:
                admit.append(i)
        if len(self.counts) > self.tracked:
            self.counts = {i: c // 2 for i, c in self.counts.items() if c // 2}
        for i in admit:  # encoded in the background: stored for the next query
            self.stored_set.add(i)
            self.reads[i], self.last[i] = 0, t
            self.encodes += 1
        if len(self.stored_set) > self.capacity:
            self._evict(t)
        return missing

    def _evict(self, t: int) -> None:
        ids = np.fromiter(self.stored_set, dtype=np.int64)
        heat = (self.reads[ids] + 1) * 0.5 ** ((t - self.last[ids]) / self.half_life)
        drop = len(ids) - int(LOW_WATER * self.capacity)
        for i in ids[np.argpartition(heat, drop)[:drop]].tolist():
            self.stored_set.discard(i)

    @property
    def stored(self) -> int:
        return len(self.stored_set)


def simulate(policy, trace: list[list[int]], costs: dict) -> dict:
    """Run `trace` through `policy`; figures over its second half."""
    ttft = costs["ttft_s"]
    half = len(trace) // 2
    missing, looked_up, times = 0, 0, []
    encodes_before = 0
    for t, ids in enumerate(trace):
        if t == half:
            encodes_before = policy.encodes
        m = policy.query(ids, t)
        if t >= half:
            missing += m
            looked_up += len(ids)
            times.append(ttft[min(m, len(ttft) - 1)])
    mean = statistics.fmean(times)
    return {"policy": policy.name, "hit_rate": 1 - missing / looked_up, "mean_ttft_s": mean,
            "p99_ttft_s": float(np.percentile(times, 99)), "encodes": policy.encodes,
            "encodes_per_query_late": (policy.encodes - encodes_before) / (len(trace) - half),
            "stored": policy.stored}


def study(n: int, skew: float, queries: int, costs: dict, budgets=BUDGETS, seed: int = 0,
          half_life: float | None = None) -> list[dict]:
    trace = zipf_trace(n, skew, queries, costs["k"], seed)
    # heat halves over the queries that read about the store's worth of chunks once
    rows = []
    base = simulate(Everything(n), trace, costs)
    gain_all = costs["full_s"] - base["mean_ttft_s"]
    for row, budget in [(base, 100)] + [
            (simulate(cls(n, max(1, n * b // 100), **kw) if cls is HotSet
                      else cls(max(1, n * b // 100)), trace, costs), b)
            for b in budgets for cls, kw in (
                (HotSet, {"half_life": half_life or max(1.0, n * b / 100 / costs["k"]),
                          "tracked": max(1, n * b // 100)}),
                (FirstUse, {}))]:
        row.update(corpus=n, skew=skew, budget_pct=budget,
                   gain_share=(costs["full_s"] - row["mean_ttft_s"]) / gain_all,
                   encode_share=row["encodes"] / n,
                   store_bytes=row["stored"] * costs["blob_bytes"])
        rows.append(row)
    return rows


# ---- validation against the engine --------------------------------------------------------
def validate(model: str, n: int, queries: int, skew: float, budget_pct: int, costs: dict,
             seed: int = 0) -> dict:
    """The real engine (admit_after=2, a disk budget of `budget_pct`% of the corpus bytes, no
    memory tier) on a Zipf trace, against the simulator on the same trace."""
    from ttft import make_chunks

    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.prompt_template import render_chat
    from turborag_integrations.core.settings import GenerationConfig
    from turborag_integrations.core.store import KVStore

    k = costs["k"]
    trace = zipf_trace(n, skew, queries, k, seed)
    one = GenerationConfig(max_new_tokens=1)
    capacity = max(1, n * budget_pct // 100)
    with tempfile.TemporaryDirectory() as tmp:
        store = KVStore(tmp, memory_bytes=0, disk_bytes=int(capacity * costs["blob_bytes"]))
        engine = TurboRAGEngine(model, store=store, progress=False, admit_after=2,
                                admission_tracked=capacity)
        engine.warmup()
        texts = make_chunks(engine.tokenizer, n, costs["chunk_tokens"])
        missing, looked_up, times, fulls = 0, 0, [], []
        for t, ids in enumerate(trace):
            chunks = [texts[i] for i in ids]
            prompt = render_chat(engine.tokenizer, [
                {"role": "system", "content": "Answer using only the documents."},
                {"role": "user", "content": "Documents:\n\n" + "\n\n".join(chunks)
                 + "\n\nQuestion: which lighthouse is the tallest?"}])
            stats = engine.generate(prompt, chunks=chunks, config=one).stats
            engine.admission.drain(60)  # as the simulator assumes: stored by the next query
            if t >= len(trace) // 2:
                missing += stats.cache_misses
                looked_up += len(ids)
                times.append(stats.ttft_s)
                # the machine's speed drifts between runs: the full prefill of the same prompt,
                # now, is what the TTFT is compared with
                fulls.append(engine.generate(prompt, config=one, mode="naive").stats.ttft_s)
        real = {"hit_rate": 1 - missing / looked_up, "mean_ttft_s": statistics.fmean(times),
                "full_s": statistics.fmean(fulls),
                "ttft_share_of_full": statistics.fmean(times) / statistics.fmean(fulls),
                "encodes": engine.admission.stats.encoded,
                "evictions": engine.store.stats().disk_evictions}
        engine.close()
    # the disk tier halves heat once a day: over a validation run, none
    sim = simulate(HotSet(n, capacity, half_life=1e12, tracked=capacity),
                   trace, costs)
    return {"corpus": n, "queries": queries, "skew": skew, "budget_pct": budget_pct,
            "real": real, "simulated": {"ttft_share_of_full": sim["mean_ttft_s"] / costs["full_s"],
                                        **{key: sim[key] for key in ("hit_rate", "mean_ttft_s",
                                                                     "encodes")}}}


# ---- a cold store with the encoder busy -----------------------------------------------------
def cold_store(model: str, k: int, chunk_tokens: int, queries: int) -> dict:
    """TTFT of prompts whose chunks all lack a blob while the hot set's encoder is kept busy
    (admit_after=1: each request admits its k chunks, more encoding than a request's time),
    against the full prefill of the same prompts with the encoder idle, timed before and after
    (the two halves' medians guard against drift). With the encoder's yield to prefills, and
    with it off (`YIELD_S = 0`), as one run."""
    from ttft import make_chunks

    from turborag_integrations.core import admission as admission_module
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.prompt_template import render_chat
    from turborag_integrations.core.settings import GenerationConfig
    from turborag_integrations.core.store import KVStore

    one = GenerationConfig(max_new_tokens=1)
    out = {}
    default = admission_module.YIELD_S
    for label, yield_s in (("yielding", default), ("not yielding", 0.0)):
        admission_module.YIELD_S = yield_s
        with tempfile.TemporaryDirectory() as tmp:
            engine = TurboRAGEngine(model, store=KVStore(tmp, memory_bytes=0), progress=False,
                                    admit_after=1)
            engine.warmup()
            pool = make_chunks(engine.tokenizer, queries * k, chunk_tokens)
            prompts = [(render_chat(engine.tokenizer, [
                {"role": "system", "content": "Answer using only the documents."},
                {"role": "user", "content": "Documents:\n\n" + "\n\n".join(chunks)
                 + "\n\nQuestion: which lighthouse is the tallest?"}]), chunks)
                for chunks in (pool[i * k:(i + 1) * k] for i in range(queries))]

            def full() -> list[float]:
                engine.admission.drain(600)
                return [engine.generate(p, config=one, mode="naive").stats.ttft_s
                        for p, _ in prompts]

            before = full()
            cold = []
            for p, chunks in prompts:
                stats = engine.generate(p, chunks=chunks, config=one).stats
                assert stats.cache_misses == k
                cold.append(stats.ttft_s)
            busy = engine.admission.queued_now
            after = full()
            engine.close()
        baseline = before + after
        out[label] = {"cold_median_s": statistics.median(cold),
                      "cold_p99_s": float(np.percentile(cold, 99)),
                      "full_median_s": statistics.median(baseline),
                      "full_p99_s": float(np.percentile(baseline, 99)),
                      "encodes_waiting_at_the_end": busy}
    admission_module.YIELD_S = default
    return out


def main(argv=None) -> int:
    from turborag_integrations.core.models import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--k", type=int, default=6, help="chunks retrieved per query")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--corpus", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--skew", type=float, nargs="+", default=[0.6, 0.9, 1.1])
    ap.add_argument("--queries", type=int, default=None,
                    help="queries per trace (default: half the corpus size)")
    ap.add_argument("--costs", type=Path, help="a calibration saved by an earlier --json run "
                    "(its \"costs\"), instead of measuring one now")
    ap.add_argument("--validate", type=int, metavar="N", help="also run the engine over N "
                    "chunks (with --validate-queries queries) and compare")
    ap.add_argument("--validate-queries", type=int, default=1000)
    ap.add_argument("--validate-skew", type=float, default=0.9)
    ap.add_argument("--validate-budget", type=int, default=10)
    ap.add_argument("--cold-store", type=int, metavar="Q", help="only measure Q prompts whose "
                    "chunks all lack a blob, with the encoder busy, against the full prefill")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    if args.cold_store:
        result = cold_store(args.model, args.k, args.chunk_tokens, args.cold_store)
        if args.json:
            print(json.dumps(result))
        else:
            for label, r in result.items():
                print(f"encoder {label}: cold prompts median {r['cold_median_s']:.3f} s, p99 "
                      f"{r['cold_p99_s']:.3f} s; full prefill (encoder idle) median "
                      f"{r['full_median_s']:.3f} s, p99 {r['full_p99_s']:.3f} s; "
                      f"{r['encodes_waiting_at_the_end']} encodes still queued at the end")
        return 0
    if args.k < 1 or args.chunk_tokens < 8 or any(n < 10 for n in args.corpus):
        ap.error("--k ≥ 1, --chunk-tokens ≥ 8 and every --corpus ≥ 10")
    if args.costs:
        costs = json.loads(args.costs.read_text())
        costs = costs.get("costs", costs)
    else:
        costs = calibrate(args.model, args.k, args.chunk_tokens)
    rows = [r for n in args.corpus for s in args.skew
            for r in study(n, s, args.queries or n // 2, costs)]
    report = {"costs": costs, "rows": rows}
    if args.validate:
        report["validation"] = validate(args.model, args.validate, args.validate_queries,
                                        args.validate_skew, args.validate_budget, costs)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"costs ({costs['model']}, {costs['k']} × {costs['chunk_tokens']} tokens): full "
          f"prefill {costs['full_s']:.3f} s; TTFT with m chunks unencoded: "
          + ", ".join(f"{m}: {s:.3f}" for m, s in enumerate(costs["ttft_s"]))
          + f" s; encode {costs['encode_s'] * 1000:.0f} ms and {costs['blob_bytes'] / 1e6:.2f} "
          "MB a chunk")
    print(f"{'corpus':>8} {'skew':>5} {'policy':>11} {'hit rate':>9} {'mean TTFT':>10} "
          f"{'p99 TTFT':>9} {'gain share':>11} {'encodes/N':>10} {'enc/query':>10} "
          f"{'store GB':>9}")
    for r in rows:
        name = r["policy"] + ("" if r["policy"] == "everything" else f":{r['budget_pct']}%")
        print(f"{r['corpus']:>8} {r['skew']:>5} {name:>11} {r['hit_rate']:>9.3f} "
              f"{r['mean_ttft_s']:>9.3f}s {r['p99_ttft_s']:>8.3f}s {r['gain_share']:>10.1%} "
              f"{r['encode_share']:>10.1%} {r['encodes_per_query_late']:>10.2f} "
              f"{r['store_bytes'] / 1e9:>9.1f}")
    if args.validate:
        v = report["validation"]
        print(f"validation over {v['corpus']} chunks, {v['queries']} queries, skew {v['skew']}, "
              f"budget {v['budget_pct']}%: hit rate real {v['real']['hit_rate']:.3f} / simulated "
              f"{v['simulated']['hit_rate']:.3f}; mean TTFT as a share of the full prefill's: "
              f"real {v['real']['ttft_share_of_full']:.3f} (full prefill {v['real']['full_s']:.3f}"
              f" s now) / simulated {v['simulated']['ttft_share_of_full']:.3f}; encodes "
              f"{v['real']['encodes']} / {v['simulated']['encodes']}, evictions "
              f"{v['real']['evictions']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
