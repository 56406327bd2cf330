"""Storage dtypes of a blob's tensors, decoded back to the model's dtype on load.

int8 follows KIVI (Liu et al., 2024): keys vary most across channels (a few outlier channels
carry large magnitudes), so they are quantised per channel over the chunk's tokens; values vary
most across tokens, so they are quantised per token. Symmetric scales, stored in float32.
"""

from __future__ import annotations

import torch

from ..blob import Fingerprint, KVBlob

STORAGE_DTYPES = ("native", "float32", "bfloat16", "float16", "int8")
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=dim, keepdim=True).float().clamp_min(1e-8) / 127.0
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale


def to_stored(blob: KVBlob, storage_dtype: str) -> tuple[dict[str, torch.Tensor], dict]:
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, not {storage_dtype!r}")
    tensors = {"token_ids": blob.token_ids.contiguous()}
    if storage_dtype == "int8":
        # keys [L, H, T, D]: one scale per (layer, head, channel) → reduce over tokens (dim 2)
        kq, ks = _quantize(blob.keys, dim=2)
        # values: one scale per (layer, head, token) → reduce over channels (dim 3)
        vq, vs = _quantize(blob.values, dim=3)
        tensors.update(keys=kq, key_scales=ks, values=vq, value_scales=vs)
    elif storage_dtype == "native":
        tensors.update(keys=blob.keys.contiguous(), values=blob.values.contiguous())
    else:
        dt = _FLOATS[storage_dtype]
        tensors.update(keys=blob.keys.to(dt).contiguous(), values=blob.values.to(dt).contiguous())
    return tensors, {"storage_dtype": storage_dtype}


def from_stored(tensors: dict[str, torch.Tensor], meta: dict, fingerprint: Fingerprint) -> KVBlob:
    dtype = getattr(torch, fingerprint.dtype)
    if meta.get("storage_dtype") == "int8":
        keys = (tensors["keys"].float() * tensors["key_scales"]).to(dtype)
        values = (tensors["values"].float() * tensors["value_scales"]).to(dtype)
    else:
        keys, values = tensors["keys"], tensors["values"]
        if keys.dtype != dtype:
            keys, values = keys.to(dtype), values.to(dtype)
    return KVBlob(token_ids=tensors["token_ids"], keys=keys, values=values, fingerprint=fingerprint)
