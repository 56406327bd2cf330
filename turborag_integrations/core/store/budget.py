"""Byte budgets of the disk tier, and sizes written the way people write them ("2GB", "500MiB").

The disk tier holds two kinds of blob. Chunk blobs are what ingestion paid for and what every
query reuses. Prefix blobs — the prompt heads of chat turns and question-first templates, and
RAPID's document prefixes — are written per query and rarely read twice. Both count against
`disk_bytes`, the bound of the whole tier; prefix blobs are also bounded by `prefix_bytes`, a
smaller share, so that a stream of one-off chat turns cannot push out the chunk blobs.

Each bound is, first found wins: the argument (`KVStore(disk_bytes=..., prefix_bytes=...)`), the
environment (TURBORAG_STORE_BYTES, TURBORAG_STORE_PREFIX_BYTES), or the default:

- disk_bytes: half of the room the store could grow into (the free space of its file system plus
  what it already holds), at most 100 GiB, measured when a process first writes to the store.
  It stays put as the store grows (what the store writes moves from free to held), and a store
  on a disk that others fill shrinks with it;
- prefix_bytes: a tenth of disk_bytes, at most 8 GiB (and never more than disk_bytes).
"""

from __future__ import annotations

import re

from pydantic import ByteSize, TypeAdapter, ValidationError

from .. import environment

__all__ = ["parse_size", "format_size", "requested", "resolve", "DISK_CAP", "PREFIX_CAP",
           "ENV_DISK", "ENV_PREFIX"]

DISK_CAP = 100 << 30
PREFIX_CAP = 8 << 30
ENV_DISK = environment.STORE_DISK_BYTES
ENV_PREFIX = environment.STORE_PREFIX_BYTES

# pydantic reads decimal units as the SI writes them (kB, MB, GB) and binary ones as the IEC
# does (KiB, MiB, GiB), but a bare letter as decimal: here 2G is binary, as `ls -h` and `du -h`
# print it.
_BYTE_SIZE = TypeAdapter(ByteSize)
_BARE_LETTER = re.compile(r"([kmgtpe])\s*$", re.IGNORECASE)


def parse_size(size: int | str) -> int:
    """Bytes in a size: 4096, "2GB" (2·10⁹), "2GiB" or "2G" (2·2³⁰), "1.5TB".
    Raises ValueError for anything else."""
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a size cannot be negative, got {size}")
        return size
    try:
        return int(_BYTE_SIZE.validate_python(_BARE_LETTER.sub(r"\1iB", str(size))))
    except ValidationError:
        raise ValueError(f"not a size: {size!r} (write e.g. 2GB, 500MiB or 1073741824)") from None


def format_size(n: int) -> str:
    """A byte count for people: 1536 → "1.5 KiB"."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, i = float(n), 0
    while value >= 1024 and i < len(units) - 1:
        value /= 1024
        i += 1
    return f"{n} B" if i == 0 else f"{value:.1f} {units[i]}"


def _from_env(name: str) -> int | None:
    value = environment.size(name)
    if not value:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"${name}: {exc}") from None


def requested(disk_bytes: int | str | None, prefix_bytes: int | str | None
              ) -> tuple[int | None, int | None]:
    """The bounds asked for, by argument or else by environment; None where the default applies.
    Raises ValueError, naming the variable, for a size that is not one."""
    disk = parse_size(disk_bytes) if disk_bytes is not None else _from_env(ENV_DISK)
    prefix = parse_size(prefix_bytes) if prefix_bytes is not None else _from_env(ENV_PREFIX)
    return disk, prefix


def resolve(asked: tuple[int | None, int | None], *, free: int, held: int) -> tuple[int, int]:
    """(disk_bytes, prefix_bytes): what was asked for, the defaults elsewhere, given the free
    space of the store's file system and the bytes the store holds now."""
    disk, prefix = asked
    if disk is None:
        disk = min(DISK_CAP, (free + held) // 2)
    if prefix is None:
        prefix = min(PREFIX_CAP, disk // 10)
    return disk, min(prefix, disk)
