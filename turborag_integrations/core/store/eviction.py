"""Eviction from the disk tier: which blobs go when it is over budget, and how they go safely.

Which: the coldest first. A blob's heat is its uses, halved for every `HALF_LIFE_S` it lay idle:

    heat = (reads + 1) × 0.5 ^ (idle / HALF_LIFE_S)

where idle is the time since its last read, or since it was written when that is later.

Reads come from the store's access log (`.access`), so they count whichever process made them
and whichever tier served them. A blob read often survives a flood of new blobs read once or
never (what the memory tier's TinyLFU admission gives in RAM); among blobs never read, the oldest
goes first; popularity fades with time and with the log's compactions.

How:

- One pass at a time per store: a pass holds an exclusive lock on `<root>/maintenance.lock`
  (filelock's `FileLock`: `flock` on POSIX). A writer that finds it held skips its pass — the
  holder is already making room — so a query never waits on another process's scan.
- A blob is removed by unlinking its file, nothing else. A process that has the file open or
  memory-mapped keeps reading it: on Linux (and any POSIX system) the data stays until the last
  map is gone. A reader that comes after finds no file, which is a miss: the chunk is prefilled
  or re-encoded. Temp files of writers still writing are not blobs yet and are never touched.
- A blob rewritten since the pass scanned it (another inode or modification time) is spared.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from filelock import FileLock

from .files import TEMP_PREFIX

HALF_LIFE_S = 24 * 3600.0
LOW_WATER = 0.9  # a pass frees down to this share of the budget, so passes are not per write


@dataclass(frozen=True)
class Entry:
    """A blob file as a scan found it."""

    key: str
    kind: str
    path: Path
    size: int
    mtime_ns: int
    inode: int


def scan(folder: Path, kind: str, suffix: str) -> list[Entry]:
    """Every blob file under folder (two levels: `<key[:2]>/<key><suffix>`), temp files left out."""
    entries = []
    try:
        shards = [d.path for d in os.scandir(folder) if d.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    for shard in shards:
        try:
            files = list(os.scandir(shard))
        except FileNotFoundError:
            continue
        for f in files:
            if not f.name.endswith(suffix) or f.name.startswith(TEMP_PREFIX):
                continue
            try:
                st = f.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed since the listing
            entries.append(Entry(f.name[: -len(suffix)], kind, Path(f.path), st.st_size,
                                 st.st_mtime_ns, st.st_ino))
    return entries


def heat(entry: Entry, use: tuple[int, float] | None, now: float) -> float:
    """(reads + 1) halved for every HALF_LIFE_S since the last read, or the write if later."""
    reads, last_read = use or (0, 0.0)
    idle = max(0.0, now - max(entry.mtime_ns / 1e9, last_read))
    return (reads + 1) * 0.5 ** (idle / HALF_LIFE_S)


def coldest(entries: list[Entry], target: float, uses: dict[str, tuple[int, float]],
            now: float) -> list[Entry]:
    """The coldest entries whose removal brings their total size to `target` or below."""
    total = sum(e.size for e in entries)
    victims = []
    for entry in sorted(entries, key=lambda e: heat(e, uses.get(e.key), now)):
        if total <= target:
            break
        victims.append(entry)
        total -= entry.size
    return victims


def remove(entry: Entry) -> bool:
    """Unlink the blob file unless it changed since the scan. True when this call removed it."""
    try:
        st = entry.path.stat()
        if (st.st_ino, st.st_mtime_ns) != (entry.inode, entry.mtime_ns):
            return False  # rewritten meanwhile: a fresh blob, not the cold one we chose
        entry.path.unlink()
        return True
    except FileNotFoundError:
        return False


@contextmanager
def exclusive(lock_path: Path, *, wait: bool) -> Iterator[bool]:
    """Hold the store's maintenance lock for the block; yields False when another process (or
    thread) holds it and `wait` is False, or when the lock file cannot be opened without waiting
    (a read-only store)."""
    lock = FileLock(lock_path)
    try:
        lock.acquire(blocking=wait)
    except OSError:  # held elsewhere (filelock.Timeout) or a read-only folder (EACCES)
        if wait:
            raise
        yield False
        return
    try:
        yield True
    finally:
        lock.release()
