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
  over a storage shared by the whole batch ([layers, rows, kv_heads, context, dim]: what a
  batch-shared cache would allow), and the KV dtypes given.
- linear: F.linear and `gemm` (core/decode/fast.py) on every layer's q/k/v/o, gate/up and down
  weights of the model's shapes (random values), and the lm_head, for 1 and B rows.
- memory: a `sum` over a 200 MB tensor, the bandwidth a streaming read reaches here.
It then prints the bound these give for the batched/single throughput ratio with no other cost:
B × (linear₁ + attention₁) / (linear_B + attention_B), with today's per-request SDPA and with the
shared-storage matmul. Times are the best of --repeats passes.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AutoConfig

from turborag_integrations.core.decode.fast import gemm
from turborag_integrations.core.models import CATALOG, DEFAULT_MODEL, prepare_bundled


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


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

    kv_bytes = rows * layers * 2 * kv_heads * context * dim * caches[0][0].element_size()
    out = {"kv_mb": kv_bytes / 1e6}
    for name, fn in (("sdpa", sdpa), ("grouped_bmm", grouped_bmm),
                     ("shared_matmul", shared_matmul)):
        seconds = best_of(fn, repeats)
        out[name + "_ms"] = seconds * 1e3
        out[name + "_gb_s"] = kv_bytes / seconds / 1e9
    return out


def linear_cost(config, rows: int, repeats: int) -> dict:
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    shapes = {"q/o": (heads * dim, hidden), "k/v": (kv_heads * dim, hidden),
              "gate/up": (inter, hidden), "down": (hidden, inter)}
    per_layer = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
    layers = config.num_hidden_layers
    out = {}
    total = {"linear": 0.0, "gemm": 0.0, "best": 0.0}
    for part, (o, i) in shapes.items():
        weights = [torch.randn(o, i) for _ in range(layers)]
        x = torch.randn(rows, i)
        for name, fn in (("linear", F.linear), ("gemm", gemm)):
            seconds = best_of(lambda: [fn(x, w) for w in weights], repeats)
            out[f"{part}_{name}_ms"] = seconds * 1e3 * per_layer[part]
            total[name] += out[f"{part}_{name}_ms"]
        total["best"] += min(out[f"{part}_linear_ms"], out[f"{part}_gemm_ms"])
    head = torch.randn(config.vocab_size, hidden)
    x = torch.randn(rows, hidden)
    for name, fn in (("linear", F.linear), ("gemm", gemm)):
        out[f"lm_head_{name}_ms"] = best_of(lambda: fn(x, head), repeats) * 1e3
    lm = min(out["lm_head_linear_ms"], out["lm_head_gemm_ms"])
    out["layers_linear_ms"], out["layers_gemm_ms"] = total["linear"], total["gemm"]
    out["layers_best_ms"] = total["best"]
    out["total_best_ms"] = total["best"] + lm
    return out


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
            report["linear"][str(r)] = linear_cost(config, r, args.repeats)
    one, many = str(1), str(args.rows)
    att = report["attention"][args.kv_dtypes[0]]
    single = report["linear"][one]["total_best_ms"] + att[one]["sdpa_ms"]
    batched = report["linear"][many]["total_best_ms"] + att[many]["sdpa_ms"]
    report["bound_ratio"] = args.rows * single / batched
    single = report["linear"][one]["total_best_ms"] + min(att[one]["sdpa_ms"],
                                                           att[one]["shared_matmul_ms"])
    batched = report["linear"][many]["total_best_ms"] + att[many]["shared_matmul_ms"]
    report["bound_ratio_shared"] = args.rows * single / batched
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.model}: {args.rows} rows, {args.context}-token caches, "
          f"{report['threads']} threads; streaming read {report['memory_gb_s']:.1f} GB/s")
    print(f"{'part':34s} {'1 row':>10s} {f'{args.rows} rows':>10s}")
    for name, rows in report["attention"].items():
        for key in ("sdpa", "grouped_bmm", "shared_matmul"):
            a, b = rows[one], rows[many]
            print(f"{f'attention {name} {key}':34s} {a[key + '_ms']:8.1f}ms {b[key + '_ms']:8.1f}ms"
                  f"   ({b[key + '_gb_s']:.1f} GB/s over {b['kv_mb']:.0f} MB)")
    for key in ("layers_linear", "layers_gemm", "layers_best", "lm_head_linear", "lm_head_gemm",
                "total_best"):
        a, b = report["linear"][one][key + "_ms"], report["linear"][many][key + "_ms"]
        print(f"{key:34s} {a:8.1f}ms {b:8.1f}ms")
    print(f"bound on batched/single decode throughput, no other cost: "
          f"{report['bound_ratio']:.2f}x (per-request SDPA), "
          f"{report['bound_ratio_shared']:.2f}x (batch-shared storage)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
