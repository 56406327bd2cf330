"""Which documents use which blob, on disk, safe across processes without a database.

Blobs are content-addressed, so two documents can share one. Each (document, blob) pair is an
empty marker file in both directions — `docs/<digest of the document id>/<key>` and
`refs/<key>/<digest>` — and a blob is free when its last document goes.
"""

from __future__ import annotations

from pathlib import Path

import xxhash


class DocumentRefs:
    """The `docs/` and `refs/` marker folders under a disk tier's root."""

    def __init__(self, root: Path):
        self.root = root

    def _doc_dir(self, doc_id: str) -> Path:
        return self.root / "docs" / xxhash.xxh3_64_hexdigest(doc_id.encode())

    def add(self, key: str, doc_id: str) -> None:
        doc = self._doc_dir(doc_id)
        ref = self.root / "refs" / key
        doc.mkdir(parents=True, exist_ok=True)
        ref.mkdir(parents=True, exist_ok=True)
        (doc / key).touch()
        (ref / doc.name).touch()

    def share(self, key: str, other: str) -> None:
        """Record every document that uses `key` as a user of `other` too."""
        ref, shared = self.root / "refs" / key, self.root / "refs" / other
        for digest in sorted(p.name for p in ref.iterdir()) if ref.exists() else []:
            doc = self.root / "docs" / digest
            doc.mkdir(parents=True, exist_ok=True)
            shared.mkdir(parents=True, exist_ok=True)
            (doc / other).touch()
            (shared / digest).touch()

    def keys_of(self, doc_id: str) -> list[str]:
        doc = self._doc_dir(doc_id)
        return sorted(p.name for p in doc.iterdir()) if doc.exists() else []

    def drop(self, doc_id: str) -> list[str]:
        """Remove the document's references; return the keys no document uses any more (the
        caller deletes their blobs)."""
        doc = self._doc_dir(doc_id)
        freed = []
        for key in self.keys_of(doc_id):
            ref_dir = self.root / "refs" / key
            (ref_dir / doc.name).unlink(missing_ok=True)
            (doc / key).unlink(missing_ok=True)
            if not any(ref_dir.iterdir()):
                ref_dir.rmdir()
                freed.append(key)
        if doc.exists() and not any(doc.iterdir()):
            doc.rmdir()
        return freed
