"""On-disk format of one blob: a safetensors file whose header carries the fingerprint and an
xxh3-128 checksum of the tensor bytes.

Safetensors is a plain header + raw little-endian tensors, so a blob reads with one file read and
no unpickling; xxh3 checks 190 MB in under 10 ms, cheap enough to verify on every disk read.
"""

from __future__ import annotations

import json
import struct

import torch
import xxhash
from safetensors.torch import save as st_save

from ..blob import FORMAT_VERSION, Fingerprint, KVBlob
from ..errors import BlobCorrupted

MAGIC = "turborag-kv"


def header_and_data(raw: bytes | memoryview) -> tuple[dict, memoryview]:
    """Split a safetensors file into its JSON header and its data section."""
    view = memoryview(raw)
    if len(view) < 8:
        raise BlobCorrupted("file too short to be a blob")
    (n,) = struct.unpack("<Q", view[:8])
    if n > len(view) - 8:
        raise BlobCorrupted("header length points past the end of the file (truncated?)")
    try:
        header = json.loads(bytes(view[8:8 + n]))
    except ValueError as exc:
        raise BlobCorrupted(f"unreadable header: {exc}") from None
    return header, view[8 + n:]


def encode(blob: KVBlob, tensors: dict[str, torch.Tensor], extra: dict | None = None) -> bytes:
    """Serialise `tensors` (the stored form of `blob`) with fingerprint and checksum.

    The checksum covers the data section, which safetensors lays out deterministically, so it is
    computed on a first serialisation and the file is written from a second one that carries it.
    """
    meta = {"magic": MAGIC, "format": str(FORMAT_VERSION),
            "fingerprint": blob.fingerprint.to_json(), **(extra or {})}
    draft = st_save(tensors, metadata=meta)
    _, data = header_and_data(draft)
    meta["checksum"] = xxhash.xxh3_128_hexdigest(data)
    return st_save(tensors, metadata=meta)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I8": torch.int8, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def decode(raw, verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse a stored blob, checking its checksum when `verify`; raises BlobCorrupted.

    The tensors are views into `raw` (a writable buffer: bytearray or private mmap), not copies:
    deserialising 190 MB would cost as much as reading it.
    """
    header, data = header_and_data(raw)
    meta = header.pop("__metadata__", None) or {}
    if meta.get("magic") != MAGIC:
        raise BlobCorrupted("not a turborag KV blob (no magic in the header)")
    expected = meta.get("checksum")
    if expected is None or (verify and xxhash.xxh3_128_hexdigest(data) != expected):
        raise BlobCorrupted("checksum mismatch: the file is truncated or corrupted")
    base = len(raw) - len(data)
    declared = max((info["data_offsets"][1] for name, info in header.items()), default=0)
    if declared != len(data):
        raise BlobCorrupted(f"data section is {len(data)} bytes, header declares {declared} "
                            "(truncated or padded file)")
    tensors = {}
    try:
        for name, info in header.items():
            dtype = _DTYPES[info["dtype"]]
            begin, end = info["data_offsets"]
            count = (end - begin) // dtype.itemsize
            flat = (torch.frombuffer(raw, dtype=dtype, count=count, offset=base + begin)
                    if count else torch.empty(0, dtype=dtype))
            tensors[name] = flat.reshape(info["shape"])
    except (KeyError, ValueError, RuntimeError) as exc:
        raise BlobCorrupted(f"unparseable tensor table: {exc}") from None
    return meta, tensors


def fingerprint_of(meta: dict) -> Fingerprint:
    return Fingerprint.from_json(meta["fingerprint"])
