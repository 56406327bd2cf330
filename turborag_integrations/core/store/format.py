"""On-disk format of one blob: a safetensors file whose header carries the fingerprint and an
xxh3-128 checksum.

Safetensors is a plain header + raw little-endian tensors, so a blob reads with one file read and
no unpickling; xxh3 checks 190 MB in under 10 ms.

The header's `format` field says what the checksum covers:

- "2" (written now): the header and the data. The header enters the checksum as its parsed JSON
  written again canonically (sorted keys, no spaces), without the checksum itself, so a changed
  tensor dtype, shape, offset, storage dtype or fingerprint field fails it like a changed data
  byte does.
- "1" (stores written by earlier versions): the data section only. These files are still read;
  their header is checked for consistency instead (`_tensor_table` here, the storage layout in
  `codec.from_stored`), which catches a header that names another dtype or layout than its data
  but not every change that stays consistent. Blobs written again (after `turborag store gc
  --max-bytes 0` and a new ingestion, say) are format 2.

Any other value is refused: a file of a newer format is a miss, never a guess.

Whether a read checks the checksum is the caller's choice (`decode(verify=...)`); the header's
consistency is checked on every decode.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Callable

import torch
import xxhash
from safetensors.torch import save as st_save

from ..kv.blob import Fingerprint, KVBlob
from ..errors import BlobCorrupted

MAGIC = "turborag-kv"
FILE_FORMAT = "2"
LEGACY_FORMAT = "1"  # checksum of the data section only


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
    if not isinstance(header, dict):
        raise BlobCorrupted("the header is not a JSON object")
    return header, view[8 + n:]


def metadata(header: dict) -> dict[str, str]:
    """The header's string table (`__metadata__`); BlobCorrupted when it is not one."""
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise BlobCorrupted("the header's metadata is not a table of strings")
    return meta


def _checksum(header: dict, data: memoryview) -> str:
    """xxh3-128 of the canonical header (without its checksum), its length, then the data."""
    meta = {k: v for k, v in metadata(header).items() if k != "checksum"}
    canonical = json.dumps({**header, "__metadata__": meta}, sort_keys=True,
                           separators=(",", ":")).encode()
    digest = xxhash.xxh3_128()
    digest.update(len(canonical).to_bytes(8, "little"))  # where the header ends and data begins
    digest.update(canonical)
    digest.update(data)
    return digest.hexdigest()


def assemble(header: dict, data: bytes | memoryview) -> bytes:
    """The file of `header` and `data`, sealed: format 2, with the checksum of both in the
    header's metadata."""
    data = memoryview(data)
    meta = {**metadata(header), "format": FILE_FORMAT}
    sealed = {**header, "__metadata__": meta}
    meta["checksum"] = _checksum(sealed, data)
    text = json.dumps(sealed, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # as safetensors does: the data section starts 8-aligned
    return b"".join([struct.pack("<Q", len(text)), text, data])


def encode(blob: KVBlob, tensors: dict[str, torch.Tensor], extra: dict | None = None) -> bytes:
    """Serialise `tensors` (the stored form of `blob`) with its fingerprint, sealed by a checksum
    of header and data."""
    meta = {"magic": MAGIC, "fingerprint": blob.fingerprint.to_json(), **(extra or {})}
    header, data = header_and_data(st_save(tensors, metadata=meta))
    return assemble(header, data)


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I8": torch.int8, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def decode(raw, verify: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Parse a stored blob, checking its checksum when `verify`; raises BlobCorrupted.

    The tensors are views into `raw` (a writable buffer: bytearray or private mmap), not copies:
    deserialising 190 MB would cost as much as reading it.
    """
    header, data = header_and_data(raw)
    meta = metadata(header)
    if meta.get("magic") != MAGIC:
        raise BlobCorrupted("not a turborag KV blob (no magic in the header)")
    version = meta.get("format")
    if version not in (FILE_FORMAT, LEGACY_FORMAT):
        raise BlobCorrupted(f"blob file format {version!r} is not one this version reads "
                            f"({LEGACY_FORMAT!r}, {FILE_FORMAT!r}); written by a newer turborag?")
    expected = meta.get("checksum")
    if expected is None:
        raise BlobCorrupted("no checksum in the header")
    if verify:
        actual = (_checksum(header, data) if version == FILE_FORMAT
                  else xxhash.xxh3_128_hexdigest(data))
        if actual != expected:
            raise BlobCorrupted("checksum mismatch: the file is truncated or corrupted")
    return meta, _tensor_table(raw, header, data)


def _tensor_table(raw, header: dict, data: memoryview) -> dict[str, torch.Tensor]:
    """Views of the tensors the header lists, after checking that the table is consistent: known
    dtypes, each span as long as its shape needs, the spans tiling the data section exactly."""
    tensors, spans = {}, []
    base = len(raw) - len(data)
    try:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(x) for x in info["shape"]]
            count = math.prod(shape)
            if min(shape, default=0) < 0 or end - begin != count * dtype.itemsize:
                raise ValueError(f"{name}: shape {shape} of {info['dtype']} does not fill bytes "
                                 f"{begin}..{end}")
            spans.append((begin, end))
            flat = (torch.frombuffer(raw, dtype=dtype, count=count, offset=base + begin)
                    if count else torch.empty(0, dtype=dtype))
            tensors[name] = flat.reshape(shape)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise BlobCorrupted(f"inconsistent tensor table: {exc}") from None
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise BlobCorrupted(f"inconsistent tensor table: a gap or overlap at byte {position}")
        position = end
    if position != len(data):
        raise BlobCorrupted(f"data section is {len(data)} bytes, header declares {position} "
                            "(truncated or padded file)")
    return tensors


def fingerprint_of(meta: dict) -> Fingerprint:
    """The fingerprint a blob's header records; BlobCorrupted when there is none to trust."""
    try:
        return Fingerprint.from_json(meta["fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BlobCorrupted(f"unreadable fingerprint: {exc}") from None


@dataclass(frozen=True)
class BlobSummary:
    """What a blob is of, without its keys and values: its fingerprint, token ids and base
    position (where its first token sat when it was encoded: the anchor's and any context's
    length)."""

    fingerprint: Fingerprint
    token_ids: tuple[int, ...]
    base_position: int = 0

    @classmethod
    def of(cls, blob: KVBlob) -> "BlobSummary":
        return cls(blob.fingerprint, tuple(blob.token_ids.tolist()), blob.base_position)


def summary(read: Callable[[int, int], bytes]) -> BlobSummary:
    """A stored blob's fingerprint, token ids and base position from three small reads of its
    file (`read(offset, length)`): the header's length, the header, the token ids. Nothing is
    verified — the checksum covers the whole file, which is the point not to read — so the
    caller checks the ids against the blob's content address (`chunk_key`), which they must
    reproduce."""
    head = read(0, 8)
    if len(head) < 8:
        raise BlobCorrupted("file too short to be a blob")
    (n,) = struct.unpack("<Q", head)
    header, _ = header_and_data(head + read(8, n))
    meta = metadata(header)
    if meta.get("magic") != MAGIC:
        raise BlobCorrupted("not a turborag KV blob (no magic in the header)")
    try:
        info = header["token_ids"]
        begin, end = (int(x) for x in info["data_offsets"])
        dtype = _DTYPES[info["dtype"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise BlobCorrupted(f"no token ids in the header: {exc}") from None
    raw = read(8 + n + begin, end - begin)
    if len(raw) != end - begin or (end - begin) % dtype.itemsize or dtype.is_floating_point:
        raise BlobCorrupted("the token ids are truncated or not integers")
    ids = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    try:
        base = int(meta.get("base_position", 0))
    except ValueError:
        raise BlobCorrupted(f"unreadable base position {meta['base_position']!r}") from None
    return BlobSummary(fingerprint_of(meta), tuple(int(i) for i in ids.tolist()), base)
