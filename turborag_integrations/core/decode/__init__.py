"""Decode: tokens after a prefill.

sampling (warping, drawing, speculative acceptance: imports only torch and settings) → matmul
(how a Linear layer meets a few rows) → fast (one-step and few-token forwards; several tokens attend through core/attention.py's split
attention) → selfspec (quantised drafts) → loop (the decode loop, text deltas and stop strings).

Below: the names callers outside decode use.
"""

from .fast import (INT8_PARTS, QUANTIZE_MODES, SUPPORTED_MODEL_TYPES, FastDecoder, stock_step,
                   unsupported_reason)
from .matmul import MATMUL_MODES, gemm, int8_available

__all__ = ["FastDecoder", "QUANTIZE_MODES", "MATMUL_MODES", "INT8_PARTS", "SUPPORTED_MODEL_TYPES",
           "gemm", "int8_available", "stock_step", "unsupported_reason"]
