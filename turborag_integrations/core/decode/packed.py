"""Linear layers prepacked for oneDNN: a product of a few rows at about the cost of one.

A batched decode step (core/decode/batch.py) multiplies B rows by every weight. PyTorch's fp32
`F.linear` (MKL) is fast for one row but not for a few: on the 2-core CPUs measured, SmolLM2's
Linear layers and lm_head took ≈20 ms for one row and ≈48 ms for eight. oneDNN's inner-product
kernel on weights reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
the path PyTorch's own compiler takes for CPU linears) took ≈29 ms for eight rows there, and a
row's result does not depend on how many rows share the call.

The packed copies hold as many bytes as the weights (≈540 MB for SmolLM2 in fp32), built once per
decoder. `PackedLinears.for_decoder` returns None where oneDNN is missing, where the packed
product gives other numbers than F.linear, or (mode "auto") where it is not clearly faster here.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch
import torch.nn.functional as F

from .. import environment
from ..settings import check_choice
from .matmul import best_time

log = logging.getLogger(__name__)

BATCH_MATMUL_MODES = ("auto", "packed", "linear")
_built: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _ops():
    mkldnn = getattr(torch.ops, "mkldnn", None)
    if mkldnn is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        return mkldnn._reorder_linear_weight, mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # pragma: no cover - depends on the torch build
        return None


class PackedLinears:
    """oneDNN-packed copies of a `FastDecoder`'s Linear layers (lm_head included), and their
    product; see the module docstring."""

    def __init__(self, fast, rows: int):
        ops = _ops()
        if ops is None:
            raise RuntimeError("oneDNN linear kernels are not available in this torch build")
        reorder, self._linear = ops
        modules = [fast.lm_head]
        for L in fast.layers:
            modules += [L.q, L.k, L.v, L.o, L.gate, L.up, L.down]
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        with torch.inference_mode():
            for m in modules:
                if type(m) is not torch.nn.Linear or m.weight.device.type != "cpu" \
                        or m.weight.dtype != torch.float32:
                    raise ValueError("packed products need float32 Linear layers on CPU")
                self._packed[id(m)] = (reorder(m.weight.detach(), rows),
                                       None if m.bias is None else m.bias.detach())

    def apply(self, x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        weight, bias = self._packed[id(module)]
        rows = x.reshape(-1, x.shape[-1])
        if not rows.is_contiguous():
            rows = rows.contiguous()
        y = self._linear(rows, weight, bias, "none", [], "")
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @classmethod
    def for_decoder(cls, fast, rows: int, mode: str | None = None) -> "PackedLinears | None":
        """The decoder's packed products for up to `rows` rows (built once per decoder), or None.

        mode: "packed" (whenever they can be built and agree with F.linear), "linear" (never) or
        "auto" (only where they are clearly faster than F.linear for `rows` rows, timed once on
        the lm_head); None reads TURBORAG_BATCH_MATMUL, default "auto"."""
        mode = check_choice("batch matmul (TURBORAG_BATCH_MATMUL)",
                            mode or environment.batch_matmul(),
                            BATCH_MATMUL_MODES)
        if mode == "linear" or _ops() is None or fast.quantize is not None:
            return None
        head = fast.lm_head
        if type(head) is not torch.nn.Linear or head.weight.device.type != "cpu" \
                or head.weight.dtype != torch.float32:
            return None
        with _lock:
            per = _built.setdefault(fast, {})
            key = (mode, rows)
            if key not in per:
                per[key] = cls._build(fast, rows, mode)
            return per[key]

    @classmethod
    def _build(cls, fast, rows: int, mode: str) -> "PackedLinears | None":
        try:
            packed = cls(fast, rows)
        except (RuntimeError, ValueError) as exc:
            log.info("batched steps use F.linear: %s", exc)
            return None
        head = fast.lm_head
        x = torch.randn(rows, head.in_features, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            want = F.linear(x, head.weight, head.bias)
            got = packed.apply(x, head)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                log.warning("oneDNN's packed product disagrees with F.linear here: batched steps "
                            "use F.linear")
                return None
            if mode == "auto":
                t_linear = best_time(lambda: F.linear(x, head.weight, head.bias))
                t_packed = best_time(lambda: packed.apply(x, head))
                log.debug("batched matmul, %d rows: F.linear %.2f ms, packed %.2f ms", rows,
                          t_linear * 1e3, t_packed * 1e3)
                if t_packed >= 0.9 * t_linear:
                    return None
        return packed
