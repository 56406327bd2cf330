"""Disk tier: one safetensors file per blob, written atomically, bounded in bytes.

Layout under the store's root:

- `blobs/<key[:2]>/<key>.kv.safetensors`: chunk blobs;
- `prefixes/<key[:2]>/<key>.kv.safetensors`: prefix blobs (prompt heads, RAPID's document
  prefixes), under their own, smaller bound;
- `access.log`: reads of blobs by every process, for eviction (`.access`);
- `maintenance.lock`: held by an eviction pass (`.eviction`);
- `docs/`, `refs/`: which documents use which blob (`.docrefs`).

When a blob is verified: its checksum (of header and data, `.format`) is checked on the first
read of each version of its file — (inode, size, modification time) — in each process, and
again whenever the file is rewritten or replaced; later reads of the same version re-check only
the header's consistency. `verify` checks now, whatever was checked before.

Budget: the tier holds at most `max_bytes`, of which prefix blobs at most `prefix_bytes` (see
`.budget` for the defaults). A put that would go over first runs an eviction pass that removes
the coldest blobs (`.eviction`) down to 90% of the bound. Deleting a document still deletes the
blobs only it used; an evicted blob is a miss like any other.

Besides the tier contract it keeps which documents use which blob (`add_ref`, `delete_doc`,
`keys_of_doc`) and offers maintenance (`read_meta`, `verify`, `sweep_temp`, `size_of`, `usage`,
`shrink`).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import threading
import time
from pathlib import Path

from ..kv.blob import KVBlob
from ..errors import BlobCorrupted, TurboRAGError
from . import budget, codec, eviction, format
from .access import AccessLog
from .docrefs import DocumentRefs
from .files import TEMP_PREFIX, write_atomically
from .tier import Tier

log = logging.getLogger(__name__)
SUFFIX = ".kv.safetensors"
KINDS = ("chunk", "prefix")
_FOLDERS = {"chunk": "blobs", "prefix": "prefixes"}
# Private and writable: copy-on-write, so a tensor view written to by a caller changes its own
# copy, never the file. (MAP_POPULATE is left out: on a writable private map it copies every page.)
_MAP_FLAGS = mmap.MAP_PRIVATE


class StoreWriteError(TurboRAGError, OSError):
    """A blob could not be written (disk full, permission denied...); nothing was left behind."""


class DiskTier(Tier):
    """The durable tier: every blob put in the store is written here, within a byte budget.

    `max_bytes` and `prefix_bytes` bound the tier and its prefix blobs (int or a size such as
    "20GB"; None: the environment, else the default of `.budget`). `close` writes out the reads
    recorded since the last flush of the access log; no file stays open, and each memory map
    belongs to the blobs handed out from it.
    """

    name = "disk"
    write_through = True
    lends_views = True  # blobs are views of a memory-mapped file; see get

    def __init__(self, root: str | os.PathLike, storage_dtype: str = "native", *,
                 max_bytes: int | str | None = None, prefix_bytes: int | str | None = None):
        self.root = Path(root).expanduser()
        self.storage_dtype = storage_dtype
        if storage_dtype not in codec.STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {codec.STORAGE_DTYPES}")
        self._asked = budget.requested(max_bytes, prefix_bytes)  # a bad size fails at open
        for folder in _FOLDERS.values():
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self._verified: dict[str, tuple[int, int, int]] = {}
        self._access = AccessLog(self.root / "access.log")
        self._refs = DocumentRefs(self.root)
        self._lock_path = self.root / "maintenance.lock"
        # Bytes held per kind, counted by a scan on first need, then kept up to date with this
        # process's writes and deletes; an eviction pass counts again. Others' writes show up at
        # the next pass, so with several writers the tier can run over by what each writes
        # between its passes (a tenth of the bound at most).
        self._held: dict[str, int] | None = None
        self._limits: tuple[int, int] | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self.evictions = 0

    # ---- budget ----------------------------------------------------------------------------
    def budget(self) -> tuple[int, int]:
        """(max_bytes, prefix_bytes): the bound of the tier and of its prefix blobs."""
        with self._lock:
            return self._accounts()[1]

    def _accounts(self) -> tuple[dict[str, int], tuple[int, int]]:
        """Bytes held per kind and the bounds, counted on first need. Hold self._lock."""
        if self._held is None:
            self._held = {kind: sum(e.size for e in self._scan(kind)) for kind in KINDS}
        if self._limits is None:
            free = shutil.disk_usage(self.root).free
            self._limits = budget.resolve(self._asked, free=free, held=sum(self._held.values()))
        return self._held, self._limits

    def _scan(self, kind: str) -> list[eviction.Entry]:
        return eviction.scan(self.root / _FOLDERS[kind], kind, SUFFIX)

    def _make_room(self, kind: str, size: int) -> bool:
        """Evict what a new blob of `size` needs; False when the blob alone exceeds its bound."""
        with self._lock:
            held, (limit, prefix_limit) = self._accounts()
            bound = prefix_limit if kind == "prefix" else limit
            too_big, first = size > bound, kind not in self._warned
            over = (sum(held.values()) + size > limit
                    or (kind == "prefix" and held["prefix"] + size > prefix_limit))
            if too_big:
                self._warned.add(kind)
        if too_big:
            if first:
                setting = (f"prefix_bytes or ${budget.ENV_PREFIX}" if kind == "prefix"
                           else f"disk_bytes or ${budget.ENV_DISK}")
                log.warning("a %s blob of %s is larger than the KV store's bound of %s for "
                            "it, so it is not stored; raise %s to keep blobs this large",
                            kind, budget.format_size(size), budget.format_size(bound), setting)
            return False
        if over:
            self._evict(kind, size)
        return True

    def _evict(self, kind: str, room: int) -> None:
        """One eviction pass making `room` bytes for a new blob of `kind`, down to LOW_WATER of
        each bound it is over. Skipped when another pass holds the store's maintenance lock."""
        with eviction.exclusive(self._lock_path, wait=False) as mine:
            if not mine:
                return
            uses, now = self._uses(), time.time()
            with self._lock:
                held, (limit, prefix_limit) = self._accounts()
                chunk_bytes = held["chunk"]
            prefixes = self._scan("prefix")
            if kind == "prefix" and _total(prefixes) + room > prefix_limit:
                prefixes = self._remove_coldest(prefixes, eviction.LOW_WATER * prefix_limit - room,
                                                uses, now)
            if chunk_bytes + _total(prefixes) + room <= limit:
                self._recount(prefixes, ("prefix",))
                return
            kept = self._remove_coldest(self._scan("chunk") + prefixes,
                                        eviction.LOW_WATER * limit - room, uses, now)
            self._recount(kept, KINDS)

    def shrink(self, max_bytes: int) -> list[str]:
        """Evict the coldest blobs, of either kind, until the tier holds at most max_bytes.
        Waits for a pass of another process to end. Returns the keys removed."""
        with eviction.exclusive(self._lock_path, wait=True):
            uses, now = self._uses(), time.time()
            entries = self._scan("chunk") + self._scan("prefix")
            kept = self._remove_coldest(entries, max_bytes, uses, now)
            self._recount(kept, KINDS)
        survivors = {e.path for e in kept}
        return sorted(e.key for e in entries if e.path not in survivors)

    def _uses(self) -> dict[str, tuple[int, float]]:
        """Every process's recorded reads, this one's included. Hold the maintenance lock."""
        if self._access.flush():
            self._access.compact()
        return self._access.read()

    def _remove_coldest(self, entries: list[eviction.Entry], target: float,
                        uses: dict[str, tuple[int, float]], now: float) -> list[eviction.Entry]:
        """Remove the coldest entries down to `target` bytes; returns the entries kept."""
        removed = set()
        for entry in eviction.coldest(entries, target, uses, now):
            if eviction.remove(entry):
                removed.add(entry.path)
                self._verified.pop(entry.key, None)
        if removed:
            self.evictions += len(removed)
            log.info("evicted %d cold KV blob(s) from %s to stay within its budget", len(removed),
                     self.root)
        return [e for e in entries if e.path not in removed]

    def _recount(self, entries: list[eviction.Entry], kinds: tuple[str, ...]) -> None:
        with self._lock:
            if self._held is not None:
                for kind in kinds:
                    self._held[kind] = _total(e for e in entries if e.kind == kind)

    def usage(self) -> dict[str, dict[str, int]]:
        """{kind: {"blobs": count, "bytes": size}} from a scan now."""
        out = {}
        for kind in KINDS:
            entries = self._scan(kind)
            out[kind] = {"blobs": len(entries), "bytes": _total(entries)}
        return out

    # ---- the tier contract ----------------------------------------------------------------
    def path(self, key: str, kind: str | None = None) -> Path:
        """The file of key's blob of `kind`; without a kind, the file that exists (chunk first),
        or the chunk file's path when there is none."""
        if kind is not None:
            return self.root / _FOLDERS[kind] / key[:2] / f"{key}{SUFFIX}"
        for candidate in (self.path(key, k) for k in KINDS):
            if candidate.exists():
                return candidate
        return self.path(key, "chunk")

    def contains(self, key: str) -> bool:
        return any(self.path(key, kind).exists() for kind in KINDS)

    def put(self, key: str, blob: KVBlob, kind: str = "chunk") -> int:
        """Write atomically (temp file in the same folder, fsync, rename), after evicting what
        the blob needs. Returns bytes written; 0 when the blob alone is over its bound.

        `kind` is "chunk" or "prefix" (a prompt head or RAPID prefix: bounded apart). Two
        writers of one key both rename a complete file over the same name, so whoever wins
        leaves a valid blob and neither fails.
        """
        if kind not in KINDS:
            raise ValueError(f"a blob's kind is one of {KINDS}, not {kind!r}")
        tensors, meta = codec.to_stored(blob, self.storage_dtype)
        payload = format.encode(blob, tensors, {**meta, "key": key})
        if not self._make_room(kind, len(payload)):
            return 0
        target = self.path(key, kind)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(target, [payload])
        except OSError as exc:
            reason = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
                      errno.EROFS: "the file system is read-only",
                      errno.EDQUOT: "the disk quota is exceeded",
                      errno.EFBIG: "the file is larger than this process may write (its file "
                                   "size limit, ulimit -f, or the file system's)"
                      }.get(exc.errno, exc.strerror)
            remedy = ("Raise that limit, or lower disk_bytes / prefix_bytes so that blobs this "
                      "large are not stored" if exc.errno == errno.EFBIG else
                      "Free space or choose another store folder (--kv-store, TURBORAG_STORE)")
            raise StoreWriteError(exc.errno, f"could not write KV blob to {target}: {reason}. "
                                  f"{remedy}.") from exc
        with self._lock:
            if self._held is not None:
                self._held[kind] += len(payload)
        for other in KINDS:  # a blob has one kind: the latest put's
            if other != kind:
                self._unlink(key, other)
        return len(payload)

    def get(self, key: str) -> KVBlob | None:
        """The verified blob under key, or None when absent. Corruption raises BlobCorrupted.

        The file is memory-mapped (private, copy-on-write): the tensors are views of the page
        cache, so a read copies nothing, and the stitcher copies each byte once, into the KV
        cache. See the module docstring for when the checksum is checked. The read is recorded
        in the access log.
        """
        return self._load(key, record=True)

    def _load(self, key: str, *, record: bool) -> KVBlob | None:
        for kind in KINDS:
            path = self.path(key, kind)
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())
                    if st.st_size == 0:
                        raise BlobCorrupted(f"{path}: empty file")
                    raw = mmap.mmap(f.fileno(), st.st_size, flags=_MAP_FLAGS,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except FileNotFoundError:
                continue
            blob = self._decode(key, path, raw, (st.st_ino, st.st_size, st.st_mtime_ns))
            if record:
                self.note_read(key)
            return blob
        return None

    def _decode(self, key: str, path: Path, raw: mmap.mmap, version: tuple[int, int, int]
                ) -> KVBlob:
        try:
            blob = codec.read(raw, key, verify=self._verified.get(key) != version)
        except (BlobCorrupted, KeyError, TypeError, ValueError) as exc:
            self._verified.pop(key, None)
            raise BlobCorrupted(f"{path}: {exc}") from None
        self._verified[key] = version
        return blob

    def note_read(self, key: str) -> None:
        """Record a read of key, whichever tier served it, for the eviction policy."""
        if self._access.note(key):
            with eviction.exclusive(self._lock_path, wait=False) as mine:
                if mine:
                    self._access.compact()

    def verify(self, key: str) -> None:
        """Check one blob's checksum now, whatever was verified before; raises BlobCorrupted.
        Not a use: eviction does not count it as a read."""
        self._verified.pop(key, None)
        self._load(key, record=False)

    def read_meta(self, key: str) -> dict | None:
        """The header metadata of key's blob, unverified; None when absent."""
        for kind in KINDS:
            path = self.path(key, kind)
            try:
                with open(path, "rb") as f:
                    head = f.read(8)
                    if len(head) < 8:
                        raise BlobCorrupted(f"{path}: truncated header")
                    n = int.from_bytes(head, "little")
                    header, _ = format.header_and_data(head + f.read(n))
            except FileNotFoundError:
                continue
            return format.metadata(header)
        return None

    def peek(self, key: str) -> format.BlobSummary | None:
        """What key's blob is of (fingerprint, token ids), read from its header and its token
        ids only, unverified (format.summary); None when absent. Not a use of the blob."""
        for kind in KINDS:
            path = self.path(key, kind)
            try:
                with open(path, "rb") as f:
                    def read(offset: int, length: int) -> bytes:
                        f.seek(offset)
                        return f.read(length)

                    return format.summary(read)
            except FileNotFoundError:
                continue
        return None

    def delete(self, key: str) -> bool:
        self._verified.pop(key, None)
        return any([self._unlink(key, kind) for kind in KINDS])  # a list: try both

    def _unlink(self, key: str, kind: str) -> bool:
        path = self.path(key, kind)
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return False
        with self._lock:
            if self._held is not None:
                self._held[kind] = max(0, self._held[kind] - size)
        return True

    def close(self) -> None:
        self._access.flush()

    # ---- document references (.docrefs) ----------------------------------------------------
    def add_ref(self, key: str, doc_id: str) -> None:
        self._refs.add(key, doc_id)

    def share_refs(self, key: str, other: str) -> None:
        self._refs.share(key, other)

    def keys_of_doc(self, doc_id: str) -> list[str]:
        return self._refs.keys_of(doc_id)

    def delete_doc(self, doc_id: str) -> list[str]:
        """Drop a document's references; delete the blobs no other document uses. Returns the
        keys deleted."""
        return [key for key in self._refs.drop(doc_id) if self.delete(key)]

    def sweep_temp(self, older_than_s: float = 3600.0) -> int:
        """Remove temp files of writers that died mid-write. Young ones may belong to a live
        writer, so only files older than `older_than_s` go."""
        cutoff = time.time() - older_than_s
        removed = 0
        temps = [self.root.glob(f"{TEMP_PREFIX}*")]  # an access-log compaction's
        temps += [(self.root / folder).glob(f"*/{TEMP_PREFIX}*{SUFFIX}")
                  for folder in _FOLDERS.values()]
        for path in (p for found in temps for p in found):
            try:
                if path.stat().st_mtime <= cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def keys(self) -> list[str]:
        return sorted({path.name[: -len(SUFFIX)] for folder in _FOLDERS.values()
                       for path in (self.root / folder).glob(f"*/*{SUFFIX}")
                       if not path.name.startswith(TEMP_PREFIX)})

    def size_of(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            return 0


def _total(entries) -> int:
    return sum(e.size for e in entries)
