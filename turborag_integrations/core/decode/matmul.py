"""How the fast decode path applies a Linear layer to a few rows of activations.

`FastDecoder` (core/decode/fast.py) runs one-token steps and few-token verification forwards
with each Linear layer applied by one of these (`matmul`):
- "linear": `F.linear`, the stock arithmetic: fp32 logits bit-identical to the stock forward's
  (tested).
- "gemm": weight @ xᵀ with the single row duplicated (`gemm`). PyTorch's one-row path reads the
  weights at about half the bandwidth a two-column matrix product reaches on the CPUs measured,
  so a step over 4K tokens of context drops from ≈67 ms to ≈43 ms on SmolLM2; logits differ
  from stock in the last bits (≤1e-5 relative; greedy tokens equal in the tests).
- "auto" (default): whichever of the two is faster on the model's lm_head, timed once per model.
A few-token forward (the verification of drafts) has its own choice (`rows_matmul`; "auto"
times both on the lm_head with a few rows): PyTorch's few-row fp32 product runs far below the machine's arithmetic rate on the AVX2 CPUs
measured, so on Qwen2.5-1.5B a 5-token forward cost ≈2.5 one-token steps with F.linear (1
thread) and "gemm" computes it in about half the time of F.linear on the lm_head. Either way
the result differs from one-token steps only in the last bits.

Optionally the Linear layers (lm_head included; `skip` leaves parts such as "lm_head" in full
precision) run on reduced-precision copies, built once per model:
- `quantize="int8"`: torch.ao dynamic quantisation (int8 weights with per-output-channel scales,
  activations quantised per token at run time, fused q/k/v and gate/up projections): ≈4x fewer
  weight bytes, ≈2x faster steps at 4K context. On SmolLM2-135M the greedy answers drift from
  fp32 (identical on a minority of short RAG prompts; see benchmarks/decode.py): per-token
  uint8 activations are coarse for a model this small.
- `quantize="bf16"`: bf16 weights, fp32 in/out: answers closer to fp32, faster only on CPUs with
  native bf16.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def int8_available() -> bool:
    """Whether this torch build has dynamic int8 Linear layers (fbgemm or x86)."""
    try:
        from torch.ao.nn.quantized.dynamic import Linear  # noqa: F401
    except Exception:  # pragma: no cover - depends on the torch build
        return False
    return "fbgemm" in torch.backends.quantized.supported_engines or \
        "x86" in torch.backends.quantized.supported_engines


def int8_linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None]):
    """An int8 dynamic-quantised Linear over the rows of several fp32 Linear layers (fused)."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    weight = torch.cat([w.detach().float() for w in weights]) if len(weights) > 1 else weights[0].detach().float()
    has_bias = any(b is not None for b in biases)
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if has_bias:
            lin.bias.copy_(torch.cat([b.detach().float() if b is not None else
                                      torch.zeros(w.shape[0]) for w, b in zip(weights, biases)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear: per_channel_dynamic_qconfig},
                             dtype=torch.qint8)[0]
    return q


class Bf16Linear(torch.nn.Module):
    """fp32 in and out, bf16 weights (and inputs) inside: half the weight bytes of fp32."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                 matmul: str = "linear"):
        super().__init__()
        self.weight = torch.cat([w.detach() for w in weights]).to(torch.bfloat16).contiguous()
        has_bias = any(b is not None for b in biases)
        self.bias = torch.cat([b.detach().float() if b is not None else torch.zeros(w.shape[0])
                               for w, b in zip(weights, biases)]) if has_bias else None
        self.matmul = gemm if matmul == "gemm" else F.linear

    def forward(self, x):
        y = self.matmul(x.to(torch.bfloat16), self.weight).float()
        return y if self.bias is None else y + self.bias


MATMUL_MODES = ("auto", "linear", "gemm")
VERIFY_ROWS = 5  # a typical verification: the pending token and 4 drafts


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for a few rows of x, computed as weight @ xᵀ.

    On the CPUs measured, PyTorch's matrix-vector path for one row reads the weights at about
    half the memory bandwidth that a matrix-matrix product with two columns reaches (whole
    SmolLM2-135M, 2 threads: 47 ms against 21 ms), so a single row is duplicated into two.
    Results differ from F.linear in the last bits (another summation order).
    """
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        y = torch.mm(weight, rows.expand(2, -1).contiguous().t())[:, :1].t()
    else:
        y = torch.mm(weight, rows.t()).t()
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def best_time(fn, repeats: int = 3) -> float:
    """The best of `repeats` timings of `fn()`, after one call to warm it up."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def pick_matmul(weight: torch.Tensor, rows: int = 1) -> str:
    """"gemm" where it is clearly faster than F.linear for `rows` rows on this machine, else
    "linear"; timed once on the model's largest weight. On accelerators (where the few-row
    path is not the bottleneck and timing needs synchronisation) always "linear"."""
    if weight.device.type != "cpu":
        return "linear"

    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype, device=weight.device)
    with torch.inference_mode():
        t_linear = best_time(lambda: F.linear(x, weight))
        t_gemm = best_time(lambda: gemm(x, weight))
    choice = "gemm" if t_gemm < 0.9 * t_linear else "linear"
    log.debug("decode matmul, %d row(s): %s (linear %.2f ms, gemm %.2f ms)", rows, choice,
              t_linear * 1e3, t_gemm * 1e3)
    return choice
