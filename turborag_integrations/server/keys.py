"""API keys and the tenants they belong to, kept in a file that holds only the keys' hashes.

    turborag keys add acme --keys keys.json          # prints a new key for tenant "acme", once
    turborag keys list --keys keys.json
    turborag keys revoke k-3f9a1c2e --keys keys.json  # or: --tenant acme (all of its keys)
    turborag serve --keys keys.json

A key is `trk-` and 43 URL-safe characters (256 random bits); the file keeps its SHA-256, a short
id to name it by, its tenant, whether it is an admin key (which may read /metrics), and when it
was made and revoked. A key is checked by hashing what the client sent and looking the hash up,
so the file never holds anything a client could send. The server reads the file again when it
changes (checked at most once a second), so a revocation takes effect without a restart.

A tenant names a namespace of the store (core/store/namespaces.py): everything a tenant's
requests ingest, encode or find lies there and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import threading
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from ..core.store.files import write_atomically

FORMAT = "turborag-keys-1"
KEY_PREFIX = "trk-"
TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RELOAD_AFTER_S = 1.0


class KeyFileError(ValueError):
    """The keys file cannot be read or written as asked; the message says what to do."""


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the tenant its key belongs to ("" on a server without tenants)."""

    tenant: str
    admin: bool = False
    key_id: str | None = None


@dataclass
class KeyRecord:
    id: str
    tenant: str
    sha256: str
    admin: bool
    created: str
    revoked: str | None = None


def check_tenant(name: str) -> str:
    if not isinstance(name, str) or not TENANT.fullmatch(name):
        raise KeyFileError(f"a tenant name is 1 to 64 letters, digits, '.', '_' or '-', "
                           f"starting with a letter or digit; {name!r} is not one")
    return name


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class KeyFile:
    """The keys of a server, in one JSON file. Thread-safe; `lookup` is what requests call."""

    def __init__(self, path: str | os.PathLike, *, create: bool = False):
        self.path = Path(path).expanduser()
        self._lock = threading.Lock()
        self._records: list[KeyRecord] = []
        self._by_hash: dict[str, KeyRecord] = {}
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of what was read
        self._checked = 0.0
        if not self.path.exists():
            if not create:
                raise KeyFileError(f"no keys file at {self.path}: make one with "
                                   f"`turborag keys add TENANT --keys {self.path}`")
            return
        self._read()

    # ---- reading ---------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            stat = self.path.stat()
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            records = [KeyRecord(**r) for r in data["keys"]]
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise KeyFileError(f"the keys file {self.path} cannot be read: {exc}. Restore it, "
                               "or make a new one with `turborag keys add`") from None
        self._records = records
        self._by_hash = {r.sha256: r for r in records if r.revoked is None}
        self._seen = (stat.st_mtime_ns, stat.st_size)

    def _refresh(self) -> None:
        """Read the file again if it changed since it was read (at most once a second)."""
        now = time.monotonic()
        if now - self._checked < RELOAD_AFTER_S:
            return
        self._checked = now
        try:
            stat = self.path.stat()
        except OSError:
            return  # a file gone or being replaced: keep what was read
        if (stat.st_mtime_ns, stat.st_size) != self._seen:
            try:
                self._read()
            except KeyFileError:
                pass  # a half-written file by hand: keep what was read, try again later

    def lookup(self, key: str) -> Principal | None:
        """The principal of a key, or None for a key that is unknown or revoked (the caller
        cannot tell which)."""
        with self._lock:
            self._refresh()
            record = self._by_hash.get(_hash(key))
        return None if record is None else Principal(record.tenant, record.admin, record.id)

    def records(self) -> list[KeyRecord]:
        with self._lock:
            return list(self._records)

    # ---- writing ---------------------------------------------------------------------------
    def _write(self, records: list[KeyRecord]) -> None:
        payload = json.dumps({"format": FORMAT, "keys": [asdict(r) for r in records]},
                             indent=2).encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, [payload])  # a temp file of mode 0600, renamed
        self._read()

    def add(self, tenant: str, *, admin: bool = False) -> tuple[KeyRecord, str]:
        """A new key for `tenant`: (its record, the key itself — shown once, stored nowhere)."""
        check_tenant(tenant)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        record = KeyRecord(id=f"k-{secrets.token_hex(4)}", tenant=tenant, sha256=_hash(key),
                           admin=admin, created=_now())
        with self._lock:
            self._write([*self._records, record])
        return record, key

    def revoke(self, *, key_id: str | None = None, tenant: str | None = None) -> list[KeyRecord]:
        """Revoke one key by id, or every key of a tenant; returns the keys revoked."""
        if (key_id is None) == (tenant is None):
            raise KeyFileError("name one key id, or a tenant (all of its keys)")
        with self._lock:
            hit = [r for r in self._records if r.revoked is None
                   and (r.id == key_id if key_id is not None else r.tenant == tenant)]
            if not hit:
                what = f"key {key_id}" if key_id is not None else f"tenant {tenant!r}"
                raise KeyFileError(f"no live {what} in {self.path} (`turborag keys list` shows "
                                   "them)")
            when = _now()
            ids = {r.id for r in hit}
            self._write([replace(r, revoked=when) if r.id in ids else r for r in self._records])
        return [replace(r, revoked=when) for r in hit]
