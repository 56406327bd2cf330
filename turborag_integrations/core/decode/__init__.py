"""Decode: tokens after a prefill.

sampling (warping, drawing, speculative acceptance: imports only torch and settings) → fast
(one-step and few-token forwards; several tokens attend through core/attention.py's split
attention) → selfspec (quantised drafts) → loop (the decode loop, text deltas and stop strings).

The names below were importable from `turborag_integrations.core.decode` when it was one module.
"""

from .fast import (INT8_PARTS, MATMUL_MODES, QUANTIZE_MODES, SUPPORTED_MODEL_TYPES, FastDecoder,
                   gemm, int8_available, stock_step, unsupported_reason)

__all__ = ["FastDecoder", "QUANTIZE_MODES", "MATMUL_MODES", "INT8_PARTS", "SUPPORTED_MODEL_TYPES",
           "gemm", "int8_available", "stock_step", "unsupported_reason"]
