"""Storage dtypes of a blob's tensors, decoded back to the model's dtype on load.

int8 follows KIVI (Liu et al., 2024): keys vary most across channels (a few outlier channels
carry large magnitudes), so they are quantised per channel, over groups of 64 tokens; values vary
most across tokens, so they are quantised per token. Both are asymmetric (a minimum and a step
per group, in float16): on SmolLM2 this halves the logit error of symmetric per-chunk scales at
the same size, about 0.52x the bytes of bfloat16.
"""

from __future__ import annotations

import torch

from ..blob import Fingerprint, KVBlob

STORAGE_DTYPES = ("native", "float32", "bfloat16", "float16", "int8")
_FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


KEY_GROUP = 64  # tokens per key quantisation group


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 codes with a float16 minimum and step per slice along `dim`."""
    x = x.float()
    lo = x.amin(dim=dim, keepdim=True).half()
    step = ((x.amax(dim=dim, keepdim=True) - lo.float()) / 255).clamp_min(1e-8).half()
    q = torch.round((x - lo.float()) / step.float()).clamp_(0, 255).to(torch.uint8)
    return q, lo, step


def _dequantize(q: torch.Tensor, lo: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    return q.float() * step.float() + lo.float()


def _key_groups(keys: torch.Tensor) -> torch.Tensor:
    """[L, H, T, D] → [L, H, groups, KEY_GROUP, D], the last group padded by repetition."""
    L, H, T, D = keys.shape
    pad = (-T) % KEY_GROUP
    if pad:
        keys = torch.cat([keys, keys[:, :, -1:].expand(L, H, pad, D)], dim=2)
    return keys.reshape(L, H, -1, KEY_GROUP, D)


def to_stored(blob: KVBlob, storage_dtype: str) -> tuple[dict[str, torch.Tensor], dict]:
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, not {storage_dtype!r}")
    tensors = {"token_ids": blob.token_ids.contiguous()}
    if storage_dtype == "int8":
        # keys: one (min, step) per (layer, head, 64-token group, channel)
        kq, klo, kstep = _quantize(_key_groups(blob.keys), dim=3)
        # values: one (min, step) per (layer, head, token), over the channels
        vq, vlo, vstep = _quantize(blob.values, dim=3)
        tensors.update(keys=kq, key_min=klo, key_step=kstep, values=vq, value_min=vlo,
                       value_step=vstep)
    elif storage_dtype == "native":
        tensors.update(keys=blob.keys.contiguous(), values=blob.values.contiguous())
    else:
        dt = _FLOATS[storage_dtype]
        tensors.update(keys=blob.keys.to(dt).contiguous(), values=blob.values.to(dt).contiguous())
    return tensors, {"storage_dtype": storage_dtype, "base_position": str(blob.base_position)}


def from_stored(tensors: dict[str, torch.Tensor], meta: dict, fingerprint: Fingerprint) -> KVBlob:
    dtype = getattr(torch, fingerprint.dtype)
    if meta.get("storage_dtype") == "int8":
        n = tensors["token_ids"].shape[0]
        grouped = _dequantize(tensors["keys"], tensors["key_min"], tensors["key_step"])
        L, H, G, S, D = grouped.shape
        keys = grouped.reshape(L, H, G * S, D)[:, :, :n].to(dtype)
        values = _dequantize(tensors["values"], tensors["value_min"], tensors["value_step"]).to(dtype)
    else:
        keys, values = tensors["keys"], tensors["values"]
        if keys.dtype != dtype:
            keys, values = keys.to(dtype), values.to(dtype)
    return KVBlob(token_ids=tensors["token_ids"], keys=keys, values=values, fingerprint=fingerprint,
                  base_position=int(meta.get("base_position", 0)))
