"""Redis tier: KV blobs shared by every worker that points at the same Redis server.

    store = KVStore(root, remote_url="redis://cache-host:6379/0")   # or $TURBORAG_REDIS_URL

KVStore asks it after the disk tier and writes every new blob to it (`write_through`), so a chunk
encoded by one worker is a hit for the others, which copy it into their own memory and disk
tiers. It keeps the contract of `.tier.Tier`.

Layout, under a prefix (default "turborag:kv:"):

- `<prefix><key>`: the manifest, a small JSON object: the blob's size in bytes, the size and
  number of its parts, and the id of the write that made them;
- `<prefix><key>:<write id>:<i>`: part i of the blob's bytes, at most `part_bytes` each (Redis
  refuses values over 512 MB). The bytes are those the disk tier writes (`.format`): the
  fingerprint and a checksum of header and data travel with the blob and are checked on every
  read.

A write stores the parts first, each with an expiry of ten minutes, then publishes the manifest
and gives the parts their final lifetime (the TTL, or none) in one atomic step. A reader that
finds a manifest therefore finds a whole blob, and a writer that dies halfway leaves parts that
expire on their own. A part missing under a manifest (expired, or evicted under `maxmemory`) is
a miss, and the rest of the entry is dropped so that the blob can be written again.

Failures never reach the caller: Redis down, slow (past the socket timeouts) or refusing a
command is logged once per outage, and meanwhile the tier answers every lookup with a miss and
declines every write. After a failure it is left alone for `retry_after_s` seconds (a circuit
breaker), so an outage costs one timeout per interval, not one per lookup; then one call tries
again. An entry that fails its checksum, its format or its key raises `BlobCorrupted`, as in the
other tiers: the store counts it and deletes it.

Thread-safe: redis-py's client draws a connection from its pool for each command.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import threading
import time
from urllib.parse import urlsplit, urlunsplit

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:
    raise ImportError("the Redis tier needs the redis package: pip install "
                      "'turborag-integrations[redis]' (or pip install 'redis>=5')") from exc

from ..errors import BlobCorrupted
from ..kv.blob import KVBlob
from . import codec, format
from .tier import Tier

log = logging.getLogger(__name__)

__all__ = ["RedisTier", "DEFAULT_PREFIX", "DEFAULT_PART_BYTES", "MAX_PART_BYTES"]

DEFAULT_PREFIX = "turborag:kv:"
DEFAULT_PART_BYTES = 64 << 20
MAX_PART_BYTES = 512 << 20  # Redis's largest value (proto-max-bulk-len)
MANIFEST_FORMAT = "turborag-redis-1"
# How long the parts of an unfinished write live: longer than any write takes, short enough that
# a writer that died halfway does not leave them for good.
PENDING_S = 600
_UNAVAILABLE = object()  # what a command returns while Redis is skipped or failing

# Publish a write: refuse when the blob is there already (another worker won the race) or a part
# is gone (evicted while the others were written); else set the manifest and the parts' final
# lifetime together, so a reader never sees a manifest whose parts are about to vanish.
# KEYS[1]: the manifest; KEYS[2..]: the parts. ARGV[1]: the manifest; ARGV[2]: TTL (0: none).
_PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then return -1 end
end
local ttl = tonumber(ARGV[2])
for i = 2, #KEYS do
  if ttl > 0 then redis.call('EXPIRE', KEYS[i], ttl) else redis.call('PERSIST', KEYS[i]) end
end
if ttl > 0 then redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
else redis.call('SET', KEYS[1], ARGV[1]) end
return 1
"""

# Drop an entry only if its manifest is still the one read, so that a blob written again
# meanwhile by another worker is not deleted along with the old one's parts.
# KEYS[1]: the manifest; KEYS[2..]: the parts it names. ARGV[1]: the manifest as read.
_DROP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', unpack(KEYS))
return 1
"""


class RedisTier(Tier):
    """A write-through tier in a Redis server shared by several workers.

    `url` is a redis-py URL (redis://[user:password@]host:port/db, rediss:// for TLS,
    unix:///path.sock). `prefix` namespaces the keys; `ttl_s` (whole seconds, None: no expiry)
    bounds how long a blob lives after it was written (reads do not extend it); `part_bytes` is
    the most bytes one Redis value holds. `storage_dtype` is how blobs are written, as for the
    disk tier. The socket timeouts bound each command: one part must reach the server within
    `socket_timeout_s`, so raise it (or lower `part_bytes`) on a slow link. After a failure the
    tier is skipped for `retry_after_s` seconds.
    """

    name = "redis"
    write_through = True
    lends_views = False  # a blob's tensors are views of a buffer it owns alone

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX, ttl_s: int | None = None,
                 part_bytes: int = DEFAULT_PART_BYTES, storage_dtype: str = "native",
                 socket_timeout_s: float = 2.0, connect_timeout_s: float = 0.5,
                 retry_after_s: float = 30.0):
        if not 0 < part_bytes <= MAX_PART_BYTES:
            raise ValueError(f"part_bytes must be between 1 and {MAX_PART_BYTES} (Redis's "
                             f"largest value), not {part_bytes}")
        if ttl_s is not None and (int(ttl_s) != ttl_s or ttl_s < 1):
            raise ValueError(f"ttl_s is a whole number of seconds, at least 1, or None; "
                             f"not {ttl_s!r}")
        if storage_dtype not in codec.STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {codec.STORAGE_DTYPES}")
        self.url = _without_credentials(url)
        self.prefix = prefix
        self.ttl_s = int(ttl_s) if ttl_s is not None else None
        self.part_bytes = int(part_bytes)
        self.storage_dtype = storage_dtype
        self.retry_after_s = retry_after_s
        # No retries inside redis-py: a retry would multiply each timeout of an outage, and the
        # circuit breaker below decides when to try again. Reads of 1 MiB, not 64 KiB: a blob is
        # tens of MB, and redis-py's pure-Python reply parser reads it in that many pieces
        # (a 94 MB reply took 1.2x as long in 64 KiB reads). The URL's own query parameters
        # (?socket_timeout=...) win over these.
        self._client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, socket_read_size=1 << 20)
        self._publish = self._client.register_script(_PUBLISH)
        self._drop = self._client.register_script(_DROP)
        self._lock = threading.Lock()
        self._skip_until = 0.0  # time.monotonic() before which Redis is not asked
        # When the outage began (warned once; a call started after it must succeed to end it),
        # or None.
        self._down_since: float | None = None
        self._closed = False

    # ---- names ------------------------------------------------------------------------------
    def _manifest_name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def _part_names(self, key: str, manifest: dict) -> list[str]:
        return [f"{self.prefix}{key}:{manifest['write']}:{i}" for i in range(manifest["parts"])]

    # ---- the circuit breaker ----------------------------------------------------------------
    def _available(self) -> bool:
        """Whether to ask Redis now: not closed, and not within `retry_after_s` of a failure.
        In an outage, the first call after the interval is the one that tries again; the others
        keep skipping until it has an answer."""
        if self._closed:
            return False
        with self._lock:
            now = time.monotonic()
            if now < self._skip_until:
                return False
            if self._down_since is not None:
                self._skip_until = now + self.retry_after_s
            return True

    def _succeeded(self, started: float) -> None:
        if self._down_since is None:
            return
        with self._lock:
            # A command that began before the outage proves nothing about Redis now.
            back = self._down_since is not None and started > self._down_since
            if back:
                self._down_since, self._skip_until = None, 0.0
        if back:
            log.info("the Redis KV tier at %s answers again; blobs are shared through it again",
                     self.url)

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            now = time.monotonic()
            self._skip_until = now + self.retry_after_s
            first = self._down_since is None
            if first:
                self._down_since = now
        if first:
            log.warning("the Redis KV tier at %s failed (%s: %s); until it answers again, "
                        "lookups there are misses and new blobs are not shared through it (it "
                        "is tried again every %g s). Check that Redis is running and reachable "
                        "at that URL (KVStore remote_url or $TURBORAG_REDIS_URL), or raise the "
                        "tier's socket timeouts if it is only slow.", self.url,
                        type(exc).__name__, exc, self.retry_after_s)

    def _call(self, command, *args, otherwise=None, **kwargs):
        """command(*args, **kwargs), or `otherwise` when Redis is skipped or fails (a failure is
        logged once per outage)."""
        if not self._available():
            return otherwise
        started = time.monotonic()
        try:
            result = command(*args, **kwargs)
        except (redis.RedisError, OSError) as exc:
            self._failed(exc)
            return otherwise
        self._succeeded(started)
        return result

    # ---- the tier contract ------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        return bool(self._call(self._client.exists, self._manifest_name(key)))

    def get(self, key: str) -> KVBlob | None:
        """The verified blob under key, or None on a miss (or while Redis is unavailable).
        An entry that cannot be trusted raises BlobCorrupted."""
        name = self._manifest_name(key)
        raw_manifest = self._call(self._client.get, name)
        if raw_manifest is None:
            return None
        manifest = _parse_manifest(raw_manifest, name)  # BlobCorrupted when unreadable
        names = self._part_names(key, manifest)
        parts = self._call(self._client.mget, names)
        if parts is None:
            return None
        if any(part is None for part in parts):
            log.info("KV blob %s in Redis lost a part (expired or evicted); dropping it", key)
            self._call(self._drop, keys=[name, *names], args=[raw_manifest])
            return None
        size = sum(len(part) for part in parts)
        if size != manifest["bytes"]:
            raise BlobCorrupted(f"redis {name}: {size} bytes in its parts, "
                                f"{manifest['bytes']} in its manifest")
        # One copy, into a buffer of our own: the tensors are views of it, and torch wants a
        # writable buffer under them (Redis's replies are immutable bytes).
        raw, offset = bytearray(size), 0
        for part in parts:
            raw[offset:offset + len(part)] = part
            offset += len(part)
        del parts
        try:
            # Always verified: these bytes crossed a network and a process we do not control.
            return codec.read(raw, key, verify=True)
        except (BlobCorrupted, KeyError, TypeError, ValueError) as exc:
            raise BlobCorrupted(f"redis {name}: {exc}") from None

    def peek(self, key: str) -> format.BlobSummary | None:
        """What key's blob is of (fingerprint, token ids) from a few byte ranges of its parts
        (GETRANGE: the header's length, the header, the token ids), unverified as the disk
        tier's peek is (`format.summary`); None on a miss, while Redis is unavailable, or when a
        part is gone. Not a use of the blob: nothing is dropped or promoted."""
        name = self._manifest_name(key)
        raw_manifest = self._call(self._client.get, name)
        if raw_manifest is None:
            return None
        manifest = _parse_manifest(raw_manifest, name)  # BlobCorrupted when unreadable
        parts, part_bytes = self._part_names(key, manifest), manifest["part_bytes"]

        def read(offset: int, length: int) -> bytes:
            # A range may straddle parts; the manifest's part size, not ours, cuts the blob.
            length = max(0, min(length, manifest["bytes"] - offset))
            pieces = []
            while length > 0:
                i, within = divmod(offset, part_bytes)
                take = min(length, part_bytes - within)
                piece = self._call(self._client.getrange, parts[i], within, within + take - 1)
                if piece is None or len(piece) != take:  # unavailable, or a part lost
                    raise _Unreadable
                pieces.append(piece)
                offset, length = offset + take, length - take
            return b"".join(pieces)

        try:
            return format.summary(read)
        except _Unreadable:
            return None
        except BlobCorrupted as exc:
            raise BlobCorrupted(f"redis {name}: {exc}") from None

    def put(self, key: str, blob: KVBlob) -> int:
        """Write the blob in parts, then publish its manifest. Returns the bytes now held for
        key (the existing entry's when there is one), or 0 when Redis is unavailable or the
        write failed."""
        name = self._manifest_name(key)
        existing = self._held(key)
        if existing is None:
            return 0
        if existing:
            return existing
        tensors, meta = codec.to_stored(blob, self.storage_dtype)
        payload = memoryview(format.encode(blob, tensors, {**meta, "key": key}))
        manifest = {"format": MANIFEST_FORMAT, "bytes": len(payload),
                    "part_bytes": self.part_bytes,
                    "parts": -(-len(payload) // self.part_bytes),  # a blob is never empty
                    "write": secrets.token_hex(8)}
        names = self._part_names(key, manifest)
        raw_manifest = json.dumps(manifest, sort_keys=True).encode()

        def write() -> int:
            pipe = self._client.pipeline(transaction=False)
            for i, part in enumerate(names):
                pipe.set(part, payload[i * self.part_bytes:(i + 1) * self.part_bytes],
                         ex=PENDING_S)
            pipe.execute()
            return self._publish(keys=[name, *names], args=[raw_manifest, self.ttl_s or 0])

        published = self._call(write)
        if published == 1:
            return len(payload)
        # Not published: drop the parts now rather than wait for them to expire.
        self._call(self._client.delete, *names)
        if published == 0:  # another worker wrote the blob first
            return self._held(key) or 0
        return 0

    def _held(self, key: str) -> int | None:
        """Bytes of the entry under key: 0 when there is none, None when Redis is unavailable.
        An entry with an unreadable manifest is deleted, so that the blob can be written again."""
        name = self._manifest_name(key)
        raw_manifest = self._call(self._client.get, name, otherwise=_UNAVAILABLE)
        if raw_manifest is _UNAVAILABLE:
            return None
        if raw_manifest is None:
            return 0
        try:
            return _parse_manifest(raw_manifest, name)["bytes"]
        except BlobCorrupted:
            self.delete(key)
            return 0

    def delete(self, key: str) -> bool:
        name = self._manifest_name(key)
        for _ in range(5):  # each turn loses only to a worker that rewrote the entry meanwhile
            raw_manifest = self._call(self._client.get, name)
            if raw_manifest is None:
                return False
            try:
                names = self._part_names(key, _parse_manifest(raw_manifest, name))
            except BlobCorrupted:
                # The manifest no longer names its parts: find them by name. A SCAN walks the
                # whole key space, which only a damaged manifest costs.
                names = self._call(lambda: [n.decode() for n in self._client.scan_iter(
                    match=_glob_escape(f"{name}:") + "*", count=1000)], otherwise=[])
            if self._call(self._drop, keys=[name, *names], args=[raw_manifest]):
                return True
        return False

    def keys(self) -> list[str]:
        """The keys of the blobs in Redis under this prefix (SCAN: never blocks the server),
        or [] while it is unavailable."""
        names = self._call(lambda: set(self._client.scan_iter(
            match=_glob_escape(self.prefix) + "*", count=1000)))
        if names is None:
            return []
        n = len(self.prefix)
        keys = (name.decode(errors="replace")[n:] for name in names)
        return [key for key in keys if ":" not in key]  # parts are named <key>:<write>:<i>

    def close(self) -> None:
        """Close the connections; later calls are misses. Closing twice is harmless."""
        if not self._closed:
            self._closed = True
            self._client.close()


class _Unreadable(Exception):
    """A peek's range that Redis did not give whole: a miss, not a corrupted entry."""


def _parse_manifest(raw: bytes, name: str) -> dict:
    """The manifest in `raw`; BlobCorrupted unless its fields are whole and agree (a number of
    parts read from a damaged manifest must not make a reader ask for millions of keys)."""
    try:
        manifest = json.loads(raw)
        valid = (isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT
                 and all(type(manifest.get(f)) is int and manifest[f] > 0
                         for f in ("bytes", "part_bytes", "parts"))
                 and manifest["part_bytes"] <= MAX_PART_BYTES
                 and manifest["parts"] == -(-manifest["bytes"] // manifest["part_bytes"])
                 and re.fullmatch(r"[0-9a-f]+", str(manifest.get("write", ""))) is not None)
    except ValueError:
        valid = False
    if not valid:
        raise BlobCorrupted(f"redis {name}: unreadable manifest {bytes(raw[:80])!r}")
    return manifest


def _glob_escape(text: str) -> str:
    """text as a literal in a Redis MATCH pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _without_credentials(url: str) -> str:
    """The URL to show in messages: without its user name and password."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))
