"""Disk tier: one safetensors file per blob, written atomically, verified on every read."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import tempfile
from pathlib import Path
from typing import Iterator

import xxhash

from ..blob import KVBlob
from ..errors import BlobCorrupted, TurboRAGError
from . import codec, format

log = logging.getLogger(__name__)
SUFFIX = ".kv.safetensors"
# Private and writable: copy-on-write, so a tensor view written to by a caller changes its own
# copy, never the file. (MAP_POPULATE is left out: on a writable private map it copies every page.)
_MAP_FLAGS = mmap.MAP_PRIVATE


class StoreWriteError(TurboRAGError, OSError):
    """A blob could not be written (disk full, permission denied...); nothing was left behind."""


class DiskTier:
    def __init__(self, root: str | os.PathLike, storage_dtype: str = "native"):
        self.root = Path(root).expanduser()
        self.storage_dtype = storage_dtype
        if storage_dtype not in codec.STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {codec.STORAGE_DTYPES}")
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self._verified: dict[str, tuple[int, int, int]] = {}

    def path(self, key: str) -> Path:
        return self.root / "blobs" / key[:2] / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        return self.path(key).exists()

    def put(self, key: str, blob: KVBlob, extra: dict | None = None) -> int:
        """Write atomically: temp file in the same folder, fsync, rename. Returns bytes written.

        Two writers of one key both rename a complete file over the same name, so whoever wins
        leaves a valid blob and neither fails.
        """
        tensors, meta = codec.to_stored(blob, self.storage_dtype)
        payload = format.encode(blob, tensors, {**meta, "key": key, **(extra or {})})
        target = self.path(key)
        tmp_name = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".tmp-", suffix=SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp_name, target)
            tmp_name = None
        except OSError as exc:
            reason = {errno.ENOSPC: "the disk is full", errno.EACCES: "permission denied",
                      errno.EROFS: "the file system is read-only",
                      errno.EDQUOT: "the disk quota is exceeded"}.get(exc.errno, exc.strerror)
            raise StoreWriteError(exc.errno, f"could not write KV blob to {target}: {reason}. "
                                  "Free space or choose another store folder (--store / "
                                  "TURBORAG_STORE).") from exc
        finally:
            if tmp_name is not None:
                try:
                    os.unlink(tmp_name)
                except OSError:
                    pass
        return len(payload)

    def read(self, key: str) -> tuple[dict, KVBlob] | None:
        """The verified blob under key, or None when absent. Corruption raises BlobCorrupted.

        The file is memory-mapped (private, copy-on-write): the tensors are views of the page
        cache, so a read copies nothing, and the stitcher copies each byte once, into the KV
        cache. The checksum is verified on the first read of each file version (inode, size,
        mtime) in this process; a rewritten or replaced file is a new version and is verified
        again.
        """
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size == 0:
                    raise BlobCorrupted(f"{path}: empty file")
                raw = mmap.mmap(f.fileno(), st.st_size, flags=_MAP_FLAGS,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except FileNotFoundError:
            return None
        version = (st.st_ino, st.st_size, st.st_mtime_ns)
        try:
            meta, tensors = format.decode(raw, verify=self._verified.get(key) != version)
            fingerprint = format.fingerprint_of(meta)
            blob = codec.from_stored(tensors, meta, fingerprint)
        except (BlobCorrupted, KeyError, ValueError) as exc:
            self._verified.pop(key, None)
            raise BlobCorrupted(f"{path}: {exc}") from None
        self._verified[key] = version
        return meta, blob

    def verify(self, key: str) -> None:
        """Check one blob's checksum now, whatever was verified before; raises BlobCorrupted."""
        self._verified.pop(key, None)
        self.read(key)

    def read_meta(self, key: str) -> dict | None:
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise BlobCorrupted(f"{path}: truncated header")
                n = int.from_bytes(head, "little")
                header, _ = format.header_and_data(head + f.read(n))
        except FileNotFoundError:
            return None
        return header.get("__metadata__") or {}

    def delete(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    # ---- document references: which documents use which blob ------------------------------
    # Blobs are content-addressed, so two documents can share one. Each (document, blob) pair is
    # an empty marker file in both directions; a blob goes when its last document goes. Marker
    # files keep this safe across processes without a database.
    def _doc_dir(self, doc_id: str) -> Path:
        return self.root / "docs" / xxhash.xxh3_64_hexdigest(doc_id.encode())

    def add_ref(self, key: str, doc_id: str) -> None:
        doc = self._doc_dir(doc_id)
        ref = self.root / "refs" / key
        doc.mkdir(parents=True, exist_ok=True)
        ref.mkdir(parents=True, exist_ok=True)
        (doc / key).touch()
        (ref / doc.name).touch()

    def keys_of_doc(self, doc_id: str) -> list[str]:
        doc = self._doc_dir(doc_id)
        return sorted(p.name for p in doc.iterdir()) if doc.exists() else []

    def delete_doc(self, doc_id: str) -> list[str]:
        """Drop a document's references; delete the blobs no other document uses. Returns the
        keys deleted."""
        doc = self._doc_dir(doc_id)
        deleted = []
        for key in self.keys_of_doc(doc_id):
            ref_dir = self.root / "refs" / key
            (ref_dir / doc.name).unlink(missing_ok=True)
            (doc / key).unlink(missing_ok=True)
            if not any(ref_dir.iterdir()):
                ref_dir.rmdir()
                if self.delete(key):
                    deleted.append(key)
        if doc.exists() and not any(doc.iterdir()):
            doc.rmdir()
        return deleted

    def sweep_temp(self, older_than_s: float = 3600.0) -> int:
        """Remove temp files of writers that died mid-write. Young ones may belong to a live
        writer, so only files older than `older_than_s` go."""
        import time

        cutoff = time.time() - older_than_s
        removed = 0
        for path in (self.root / "blobs").glob(f"*/.tmp-*{SUFFIX}"):
            try:
                if path.stat().st_mtime <= cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def keys(self) -> Iterator[str]:
        for path in (self.root / "blobs").glob(f"*/*{SUFFIX}"):
            if not path.name.startswith(".tmp-"):
                yield path.name[: -len(SUFFIX)]

    def size_of(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            return 0
