"""The metadata keys the wrapper records, and the check of a document's recorded model.

KV blobs are valid only for the model that made them. The core never uses a blob of another
fingerprint (it would be a silent miss), but a store built for model A and queried with model B
is almost always a configuration mistake, and a silent full prefill hides it. So where the
adapters can see both fingerprints, they raise, naming both (the message is the core's, shared
with the chunk registry's check of prompts: core/registry.py).
"""

from __future__ import annotations

from ..core.registry import mismatch

KV_KEY = "turborag_kv_key"  # content address of the document's KV blob
FINGERPRINT = "turborag_fingerprint"  # Fingerprint.id of the model that made the blob
MODEL = "turborag_model"  # Fingerprint.describe() of that model, for messages
METADATA_KEYS = (KV_KEY, FINGERPRINT, MODEL)

__all__ = ["KV_KEY", "FINGERPRINT", "MODEL", "METADATA_KEYS", "mismatch", "check_metadata"]


def check_metadata(engine, metadata: dict, where: str) -> None:
    """Raise if `metadata` records a blob made by another model than `engine`'s."""
    recorded = metadata.get(FINGERPRINT)
    if recorded and recorded != engine.fingerprint.id:
        raise mismatch(engine, recorded, metadata.get(MODEL), where)
