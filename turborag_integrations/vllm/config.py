"""The connector's settings: vLLM's `kv_connector_extra_config`, read and checked once.

vLLM hands every connector the dict given in `--kv-transfer-config` as it is, so a key spelled
wrong would silently leave its default in force. `ConnectorConfig.from_extra_config` reads every
key here, once: a key the connector does not know, or a value it cannot use, stops vLLM at
startup with the key, what is wrong and what it takes (docs/vllm.md lists the keys).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..core.prefill.anchor import ANCHORS, DEFAULT_ANCHOR
from ..core.prefill.context import DEFAULT_CONTEXT_TOKENS
from ..core.store import KVStore

# the dtypes a blob's fingerprint can name (core/checkpoint.py reads the checkpoint in it)
BLOB_DTYPES = ("float32", "bfloat16", "float16")
# TokenSpanIndex files each blob under its first 8 token ids: a shorter one cannot be found
MIN_CHUNK_TOKENS = 8
NEEDS_STORE = ('TurboRAGConnector needs kv_connector_extra_config {"store": '
               '"<store folder or redis:// URL>"}: where the chunk blobs are')


@dataclass(frozen=True)
class ConnectorConfig:
    """Every key of `kv_connector_extra_config`, with the connector's defaults."""

    store: str  # a store folder or a redis:// URL, as KVStore takes it
    store_dir: str | None = None  # the local disk tier in front of a redis:// store
    # how the blobs were encoded, as TurboRAGEngine takes them: blobs of another encoding are
    # stored under other fingerprints, and never found
    encoder: str | None = "default"
    anchor: str | None = DEFAULT_ANCHOR
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    min_chunk_tokens: int = MIN_CHUNK_TOKENS  # the shortest blob the span finder indexes
    salt_prefix: str = "turborag"  # a request opts in with a cache_salt that starts with it
    public: bool = True  # requests may also use the public namespace's blobs
    refresh_s: float = 2.0  # how often the scheduler looks for newly stored blobs
    max_head_tokens: int = 512  # the longest prompt head the scheduler encodes itself
    blob_dtype: str | None = None  # the blobs' dtype where it is not vLLM's; None: vLLM's

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """The config of vLLM's `kv_connector_extra_config` (a ValueError for a key or value
        the connector cannot use)."""
        extra = dict(extra or {})
        keys = [f.name for f in fields(cls)]
        for key in extra:
            if key not in keys:
                near = difflib.get_close_matches(str(key), keys, n=1)
                hint = f' (did you mean "{near[0]}"?)' if near else ""
                raise ValueError(f"TurboRAGConnector: kv_connector_extra_config has no key "
                                 f"{key!r}{hint}; its keys are {', '.join(keys)}")
        if not extra.get("store"):
            raise ValueError(NEEDS_STORE)
        return cls(**extra)

    def __post_init__(self):
        if not _text(self.store):
            raise ValueError(NEEDS_STORE if not self.store else _wrong(
                "store", self.store, "a store folder or a redis:// URL"))
        if self.store_dir is not None and not _text(self.store_dir):
            raise ValueError(_wrong("store_dir", self.store_dir,
                                    "a folder: the disk tier in front of a redis:// store"))
        if self.encoder is not None and not _text(self.encoder):
            raise ValueError(_wrong("encoder", self.encoder, '"default", "none", a bundled '
                                    "encoder's name or the path of one, as TurboRAGEngine "
                                    "takes it"))
        if self.anchor is not None and not _text(self.anchor):
            raise ValueError(_wrong("anchor", self.anchor, f"one of {', '.join(ANCHORS)} or "
                                    "a non-empty text, as TurboRAGEngine takes it"))
        if not _whole(self.context_tokens, 0):
            raise ValueError(_wrong("context_tokens", self.context_tokens,
                                    "a whole number ≥ 0, as TurboRAGEngine takes it"))
        if not _whole(self.min_chunk_tokens, MIN_CHUNK_TOKENS):
            raise ValueError(_wrong("min_chunk_tokens", self.min_chunk_tokens,
                                    f"a whole number ≥ {MIN_CHUNK_TOKENS}"))
        if not _text(self.salt_prefix):
            raise ValueError(_wrong("salt_prefix", self.salt_prefix, "a non-empty text"))
        if not isinstance(self.public, bool):
            raise ValueError(_wrong("public", self.public, "true or false"))
        if isinstance(self.refresh_s, bool) or not isinstance(self.refresh_s, (int, float)) \
                or not self.refresh_s >= 0:
            raise ValueError(_wrong("refresh_s", self.refresh_s, "a number of seconds ≥ 0"))
        if not _whole(self.max_head_tokens, 0):
            raise ValueError(_wrong("max_head_tokens", self.max_head_tokens,
                                    "a whole number ≥ 0"))
        if self.blob_dtype is not None:
            dtype = self.blob_dtype.replace("torch.", "") if _text(self.blob_dtype) else None
            if dtype not in BLOB_DTYPES:
                raise ValueError(_wrong("blob_dtype", self.blob_dtype,
                                        f"one of {', '.join(BLOB_DTYPES)}, or no key for "
                                        "vLLM's own dtype"))
            object.__setattr__(self, "blob_dtype", dtype)  # "torch.float32" names float32 too

    def open_store(self, *, memory_bytes: int) -> KVStore:
        """The store folder, or a redis:// URL (a Redis tier behind a local disk tier in
        `store_dir`, by default the package's store folder)."""
        if self.store.startswith(("redis://", "rediss://", "unix://")):
            return KVStore(self.store_dir, remote_url=self.store, memory_bytes=memory_bytes)
        return KVStore(self.store, remote_url="", memory_bytes=memory_bytes)


def _text(value) -> bool:
    return isinstance(value, str) and bool(value)


def _whole(value, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _wrong(key: str, value, accepted: str) -> str:
    return (f'the connector\'s "{key}" (kv_connector_extra_config) is {accepted}, '
            f"not {value!r}")
