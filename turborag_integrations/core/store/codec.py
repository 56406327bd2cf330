"""Storage dtypes of a blob's tensors, decoded back to the model's dtype on load.

int8 follows KIVI (Liu et al., 2024): keys vary most across channels (a few outlier channels
carry large magnitudes), so they are quantised per channel, over groups of 64 tokens; values vary
most across tokens, so they are quantised per token. Both are asymmetric (a minimum and a step
per group, in float16): on SmolLM2 this halves the logit error of symmetric per-chunk scales at
the same size, about 0.52x the bytes of bfloat16.
"""

from __future__ import annotations

import torch

from ..errors import BlobCorrupted
from ..kv.blob import Fingerprint, KVBlob
from . import format

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


_INT8_TENSORS = {"keys": torch.uint8, "values": torch.uint8, "key_min": torch.float16,
                 "key_step": torch.float16, "value_min": torch.float16, "value_step": torch.float16}


def _model_dtype(fingerprint: Fingerprint) -> torch.dtype:
    dtype = getattr(torch, str(fingerprint.dtype), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the fingerprint names no torch dtype: {fingerprint.dtype!r}")
    return dtype


def check_layout(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Raise ValueError unless the tensors are what `to_stored` writes for meta's storage dtype.

    A header that names another layout than its data (int8 codes read as floats, a storage
    dtype that does not match the tensors) would decode to garbage KV without an error."""
    storage = meta.get("storage_dtype")
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage dtype {storage!r}")
    ids = tensors.get("token_ids")
    if ids is None or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError("token_ids is not a vector of integers")
    n = ids.shape[0]
    if storage == "int8":
        expected = _INT8_TENSORS
    else:
        # "native" keeps whatever float dtype the KV came in (the model's, as a rule).
        stored = _FLOATS.get(storage, tensors.get("keys", ids).dtype)
        if not stored.is_floating_point:
            raise ValueError(f"keys of {storage} storage are {stored}, not floats")
        expected = {"keys": stored, "values": stored}
    if set(tensors) != {"token_ids", *expected}:
        raise ValueError(f"tensors {sorted(tensors)} are not those of {storage} storage")
    for name, dtype in expected.items():
        if tensors[name].dtype != dtype:
            raise ValueError(f"{name} is {tensors[name].dtype}; {storage} storage writes {dtype}")
    keys, values = tensors["keys"], tensors["values"]
    if storage == "int8":
        agree = keys.dim() == 5 and values.dim() == 4
        if agree:
            L, H, G, S, D = keys.shape
            agree = (S == KEY_GROUP and G == -(-n // KEY_GROUP) and values.shape[:3] == (L, H, n)
                     and tensors["key_min"].shape == tensors["key_step"].shape == (L, H, G, 1, D)
                     and tensors["value_min"].shape == tensors["value_step"].shape
                     == (L, H, n, 1))
    else:
        agree = (keys.dim() == values.dim() == 4 and keys.shape[:3] == values.shape[:3]
                 and keys.shape[2] == n)
    if not agree:
        raise ValueError(f"shapes of {storage} storage do not agree with {n} tokens: "
                         + ", ".join(f"{k} {list(t.shape)}" for k, t in sorted(tensors.items())))


def from_stored(tensors: dict[str, torch.Tensor], meta: dict, fingerprint: Fingerprint) -> KVBlob:
    """The blob of a stored form, in the model's dtype; ValueError when the form is inconsistent."""
    dtype = _model_dtype(fingerprint)
    check_layout(tensors, meta)
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


def read(raw, key: str, *, verify: bool) -> KVBlob:
    """The blob a tier holds under `key`, from its stored bytes `raw`: decoded (checksum checked
    when `verify`), its header's key matched with `key`, its tensors laid out for the model.

    A sound blob under another blob's name (a file copied or renamed by hand, an entry renamed
    in Redis) passes its checksum; serving it would hand out another chunk's KV, so it is
    corrupt here. Raises BlobCorrupted, or KeyError/TypeError/ValueError for a malformed header.
    """
    meta, tensors = format.decode(raw, verify=verify)
    if meta.get("key") != key:
        raise BlobCorrupted(f"it holds the blob of key {meta.get('key')!r}")
    return from_stored(tensors, meta, format.fingerprint_of(meta))
