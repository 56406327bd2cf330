"""Where a batched decode step's time goes: attention over each request's cache, and the Linear
layers, for 1 row and for B rows, on the bundled model's shapes.

    python benchmarks/step_cost.py                   # 8 rows, 2K-token caches
    python benchmarks/step_cost.py --rows 8 --context 2048 --json

A decode step of B requests reads the weights once (the Linear layers multiply B rows) but each
request's KV cache separately. This script times the two parts apart, as they are in a real
step: every layer's weights and every (layer, request) cache are distinct tensors, visited in
order, so they come from memory, not from the CPU's cache (a loop over one small tensor would
time the cache instead).
- attention: one SDPA call per layer and request (grouped-query, one query token), as
  core/decode/batch.py makes them; also one grouped `bmm` formulation, one matmul per layer
  over a storage shared by the whole batch ([layers, rows, kv_heads, context, dim]), one
  masked SDPA call per layer over that storage (what the scheduler's `BatchArena` step does,
  core/decode/batch.py), and the KV dtypes given.
- linear: F.linear, `gemm` (core/decode/fast.py) and oneDNN's packed product
  (core/decode/packed.py) on every layer's q/k/v/o, gate/up and down weights of the model's
  shapes (random values), and the lm_head, for 1 and B rows.
- memory: a `sum` over a 200 MB tensor, the bandwidth a streaming read reaches here.
- steps: whole `BatchedDecoder.step`s of the real model (its weights, random KV in the caches)
  for one row on a cache of its own and for B rows of one `BatchArena`, as the scheduler runs
  them (medians). On a CPU whose last-level cache holds a part's weights (480 MB here and
  there) the per-part timings above come partly from that cache; the steps do not.
It then prints the bound these give for the batched/single throughput ratio with no other cost:
B × (linear₁ + attention₁) / (linear_B + attention_B), with per-request SDPA (caches of their
own), with the shared-storage matmul, and with the shared-storage masked SDPA the scheduler's
arena uses. Times are the best of --repeats passes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from turborag_integrations.core.decode.matmul import best_time as best_of, gemm
from turborag_integrations.core.decode.packed import _ops
from turborag_integrations.core.bundled import CATALOG, prepare_bundled
from turborag_integrations.core.models import DEFAULT_MODEL


def attention_cost(config, rows: int, context: int, dtype, repeats: int) -> dict:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = config.num_hidden_layers
    caches = [(torch.randn(layers, 1, kv_heads, context, dim, dtype=dtype),
               torch.randn(layers, 1, kv_heads, context, dim, dtype=dtype)) for _ in range(rows)]
    q = torch.randn(1, heads, 1, dim, dtype=dtype)
    scale = dim ** -0.5
    group = heads // kv_heads

    def sdpa():
        for layer in range(layers):
            for k, v in caches:
                F.scaled_dot_product_attention(q, k[layer], v[layer], enable_gqa=True, scale=scale)

    def grouped_bmm():
        qg = q.view(kv_heads, group, dim) * scale
        for layer in range(layers):
            for k, v in caches:
                p = torch.softmax(torch.bmm(qg, k[layer][0].transpose(1, 2)), dim=-1)
                torch.bmm(p, v[layer][0])

    shared_k = torch.randn(layers, rows, kv_heads, context, dim, dtype=dtype)
    shared_v = torch.randn(layers, rows, kv_heads, context, dim, dtype=dtype)
    qs = torch.randn(rows, kv_heads, group, dim, dtype=dtype) * scale

    def shared_matmul():
        for layer in range(layers):
            p = torch.softmax(torch.matmul(qs, shared_k[layer].transpose(-1, -2)), dim=-1)
            torch.matmul(p, shared_v[layer])

    mask = torch.zeros(rows, 1, 1, context, dtype=dtype)
    mask[0, ..., context - 16:] = float("-inf")  # rows of different lengths, as in a batch
    qp = torch.randn(rows, kv_heads, group, dim, dtype=dtype)

    def shared_sdpa():
        for layer in range(layers):
            F.scaled_dot_product_attention(qp, shared_k[layer], shared_v[layer], attn_mask=mask,
                                           scale=scale)

    kv_bytes = rows * layers * 2 * kv_heads * context * dim * caches[0][0].element_size()
    out = {"kv_mb": kv_bytes / 1e6}
    for name, fn in (("sdpa", sdpa), ("grouped_bmm", grouped_bmm),
                     ("shared_matmul", shared_matmul), ("shared_sdpa", shared_sdpa)):
        seconds = best_of(fn, repeats)
        out[name + "_ms"] = seconds * 1e3
        out[name + "_gb_s"] = kv_bytes / seconds / 1e9
    return out


def linear_cost(config, rows: int, repeats: int, pack_rows: int) -> dict:
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    shapes = {"q/o": (heads * dim, hidden), "k/v": (kv_heads * dim, hidden),
              "gate/up": (inter, hidden), "down": (hidden, inter)}
    per_layer = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
    layers = config.num_hidden_layers
    ops = _ops()
    products = {"linear": (F.linear, lambda w: w), "gemm": (gemm, lambda w: w)}
    if ops is not None:  # oneDNN on weights packed for pack_rows rows (core/decode/packed.py)
        reorder, pointwise = ops
        products["packed"] = (lambda x, w: pointwise(x, w, None, "none", [], ""),
                              lambda w: reorder(w, pack_rows))
    out = {}
    total = dict.fromkeys(list(products) + ["best"], 0.0)
    for part, (o, i) in shapes.items():
        x = torch.randn(rows, i)
        for name, (fn, prepare) in products.items():
            weights = [prepare(torch.randn(o, i)) for _ in range(layers)]
            seconds = best_of(lambda: [fn(x, w) for w in weights], repeats)
            out[f"{part}_{name}_ms"] = seconds * 1e3 * per_layer[part]
            total[name] += out[f"{part}_{name}_ms"]
        total["best"] += min(out[f"{part}_{name}_ms"] for name in products)
    x = torch.randn(rows, hidden)
    for name, (fn, prepare) in products.items():
        head = prepare(torch.randn(config.vocab_size, hidden))
        out[f"lm_head_{name}_ms"] = best_of(lambda: fn(x, head), repeats) * 1e3
        out[f"layers_{name}_ms"] = total[name]
    lm = min(out[f"lm_head_{name}_ms"] for name in products)
    out["layers_best_ms"] = total["best"]
    out["total_best_ms"] = total["best"] + lm
    return out


def step_times(source: str, rows: int, context: int, repeats: int) -> dict:
    """Median times of whole batched decode steps: 1 row, and `rows` rows of one arena."""
    from transformers import AutoModelForCausalLM

    from turborag_integrations.core.decode.batch import BatchedDecoder
    from turborag_integrations.core.kv.arena import BatchArena
    from turborag_integrations.core.kv.cache import KVCache

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    decoder = BatchedDecoder.for_model(model, rows=rows)

    def filled(n: int) -> KVCache:
        cache = KVCache.empty(model, n + 8)
        for part in cache.slot(n):
            part.normal_()
        return cache

    arena = BatchArena.for_model(model, rows, capacity=context + 8)
    batch = [arena.join(filled(context - 8 * i), room=8) for i in range(rows)]
    alone = filled(context)

    def step(caches) -> None:
        lengths = [c.length for c in caches]
        decoder.step([5] * len(caches), lengths, caches)
        for c, n in zip(caches, lengths):
            c.truncate(n)

    def median(fn) -> float:
        fn()
        times = []
        for _ in range(max(repeats, 5)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    one, many = median(lambda: step([alone])), median(lambda: step(batch))
    return {"packed": decoder.packed is not None, "1_row_ms": one * 1e3,
            f"{rows}_rows_ms": many * 1e3, "ratio": rows * one / many}


def memory_bandwidth(repeats: int) -> float:
    x = torch.randn(50_000_000)
    return x.numel() * 4 / best_of(lambda: x.sum(), repeats) / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL, help="bundled name or folder (config only)")
    ap.add_argument("--rows", type=int, default=8, help="requests in the batched step")
    ap.add_argument("--context", type=int, default=2048, help="tokens in each request's cache")
    ap.add_argument("--kv-dtypes", nargs="+", default=["float32"],
                    help="KV dtypes to time attention in (float32 bfloat16 float16)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    source = prepare_bundled(args.model, progress=False) if args.model in CATALOG else args.model
    config = AutoConfig.from_pretrained(source)
    with torch.inference_mode():
        report = {"model": args.model, "rows": args.rows, "context": args.context,
                  "threads": torch.get_num_threads(),
                  "memory_gb_s": memory_bandwidth(args.repeats), "attention": {}, "linear": {}}
        for name in args.kv_dtypes:
            dtype = getattr(torch, name)
            report["attention"][name] = {
                str(r): attention_cost(config, r, args.context, dtype, args.repeats)
                for r in (1, args.rows)}
        for r in (1, args.rows):
            report["linear"][str(r)] = linear_cost(config, r, args.repeats, args.rows)
        report["steps"] = step_times(source, args.rows, args.context, args.repeats)
    one, many = str(1), str(args.rows)
    att = report["attention"][args.kv_dtypes[0]]
    single = report["linear"][one]["total_best_ms"] + att[one]["sdpa_ms"]
    batched = report["linear"][many]["total_best_ms"] + att[many]["sdpa_ms"]
    report["bound_ratio"] = args.rows * single / batched
    single = report["linear"][one]["total_best_ms"] + min(att[one]["sdpa_ms"],
                                                           att[one]["shared_matmul_ms"])
    batched = report["linear"][many]["total_best_ms"] + att[many]["shared_matmul_ms"]
    report["bound_ratio_shared"] = args.rows * single / batched
    batched = report["linear"][many]["total_best_ms"] + att[many]["shared_sdpa_ms"]
    report["bound_ratio_arena"] = args.rows * single / batched
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.model}: {args.rows} rows, {args.context}-token caches, "
          f"{report['threads']} threads; streaming read {report['memory_gb_s']:.1f} GB/s")
    print(f"{'part':34s} {'1 row':>10s} {f'{args.rows} rows':>10s}")
    for name, rows in report["attention"].items():
        for key in ("sdpa", "grouped_bmm", "shared_matmul", "shared_sdpa"):
            a, b = rows[one], rows[many]
            print(f"{f'attention {name} {key}':34s} {a[key + '_ms']:8.1f}ms {b[key + '_ms']:8.1f}ms"
                  f"   ({b[key + '_gb_s']:.1f} GB/s over {b['kv_mb']:.0f} MB)")
    products = [k[len("layers_"):-len("_ms")] for k in report["linear"][one]
                if k.startswith("layers_") and k != "layers_best_ms"]
    for key in ([f"layers_{p}" for p in products] + ["layers_best"]
                + [f"lm_head_{p}" for p in products] + ["total_best"]):
        a, b = report["linear"][one][key + "_ms"], report["linear"][many][key + "_ms"]
        print(f"{key:34s} {a:8.1f}ms {b:8.1f}ms")
    print(f"bound on batched/single decode throughput, no other cost: "
          f"{report['bound_ratio']:.2f}x (per-request SDPA), "
          f"{report['bound_ratio_shared']:.2f}x (batch-shared storage, matmul), "
          f"{report['bound_ratio_arena']:.2f}x (batch-shared storage, masked SDPA: the arena)")
    st = report["steps"]
    print(f"whole steps of the model (packed products: {st['packed']}): 1 row "
          f"{st['1_row_ms']:.1f} ms, {args.rows} rows of one arena {st[f'{args.rows}_rows_ms']:.1f} ms: "
          f"{st['ratio']:.2f}x the tokens/s of one row")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
