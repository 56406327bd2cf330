"""The access log of a store: which blobs were read, how often and when, by every process.

The disk tier's eviction keeps what is read (see `.eviction`), so it must know about reads that
file times cannot tell: access times are not kept on `noatime` mounts, and a blob served from a
memory tier never touches its file. Every process sharing the store records its reads here.

The log is one text file of lines `<key> <reads> <unix time of the last read>`:

- Recording is an append. A process buffers its reads and appends them in one write every
  `FLUSH_READS` reads or `FLUSH_S` seconds (and when asked: before an eviction pass, on close).
  Appends with O_APPEND land whole at the end of a local file, so writers need no lock; a reader
  that meets a torn line skips it. A process that dies loses its last batch at most.
- Reading sums the lines per key.
- When the file grows past `max_bytes`, it is compacted by whoever holds the store's
  maintenance lock: one line per key, every count halved — old popularity fades, as in TinyLFU —
  and keys left with none dropped. That bounds the file. Reads another process appends while a
  compaction runs are lost: the counts are a heuristic, and a few reads more or less only change
  which cold blob goes first.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from .files import write_atomically

log = logging.getLogger(__name__)

FLUSH_READS = 256
FLUSH_S = 10.0


class AccessLog:
    """Reads of blobs, buffered in this process and appended to a file shared by all of them."""

    def __init__(self, path: str | os.PathLike, *, max_bytes: int = 1 << 20):
        self.path = Path(path)
        self.max_bytes = max_bytes
        self._pending: list[str] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()

    def note(self, key: str) -> bool:
        """Record one read of key. True when the file has grown past its bound (the caller
        compacts it under the maintenance lock)."""
        with self._lock:
            self._pending.append(f"{key} 1 {time.time():.0f}\n")
            due = (len(self._pending) >= FLUSH_READS
                   or time.monotonic() - self._last_flush >= FLUSH_S)
        return self.flush() if due else False

    def flush(self) -> bool:
        """Append the buffered reads. True when the file has grown past its bound."""
        with self._lock:
            lines, self._pending = self._pending, []
            self._last_flush = time.monotonic()
        if not lines:
            return False
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
            try:
                os.write(fd, "".join(lines).encode())
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
        except OSError as exc:
            # A read-only store still serves reads; eviction then knows less, nothing breaks.
            log.debug("could not record reads in %s: %s", self.path, exc)
            return False
        return size > self.max_bytes

    def read(self) -> dict[str, tuple[int, float]]:
        """{key: (reads, time of the last read)} over every line of the file."""
        try:
            text = self.path.read_text(errors="replace")
        except FileNotFoundError:
            return {}
        uses: dict[str, tuple[int, float]] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) != 3:
                continue  # a torn append
            try:
                reads, when = int(parts[1]), float(parts[2])
            except ValueError:
                continue
            before, last = uses.get(parts[0], (0, 0.0))
            uses[parts[0]] = (before + reads, max(last, when))
        return uses

    def compact(self) -> None:
        """Rewrite the file with one line per key and halved counts. Call it holding the store's
        maintenance lock: two compactions at once would each drop the other's result."""
        lines = [f"{key} {reads // 2} {when:.0f}\n"
                 for key, (reads, when) in self.read().items() if reads // 2 > 0]
        try:
            write_atomically(self.path, [line.encode() for line in lines], durable=False)
        except OSError as exc:
            log.debug("could not compact %s: %s", self.path, exc)
