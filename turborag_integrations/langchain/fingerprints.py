"""The metadata keys the wrapper records, and the error for a store used with the wrong model.

KV blobs are valid only for the model that made them. The core never uses a blob of another
fingerprint (it would be a silent miss), but a store built for model A and queried with model B
is almost always a configuration mistake, and a silent full prefill hides it. So where the
adapters can see both fingerprints, they raise, naming both.
"""

from __future__ import annotations

from ..core.errors import FingerprintMismatch

KV_KEY = "turborag_kv_key"  # content address of the document's KV blob
FINGERPRINT = "turborag_fingerprint"  # Fingerprint.id of the model that made the blob
MODEL = "turborag_model"  # Fingerprint.describe() of that model, for messages
METADATA_KEYS = (KV_KEY, FINGERPRINT, MODEL)


def mismatch(engine, recorded_id: str, recorded_model: str | None,
             where: str) -> FingerprintMismatch:
    fp = engine.fingerprint
    return FingerprintMismatch(
        f"{where} was ingested for another model: {recorded_model or '?'} (fingerprint "
        f"{recorded_id}), but this engine runs {fp.describe()} (fingerprint {fp.id}). Its KV "
        "blobs cannot be used with this model: use the model that built the store, or re-ingest "
        "the documents with this one (a new collection or store directory).")


def check_metadata(engine, metadata: dict, where: str) -> None:
    """Raise if `metadata` records a blob made by another model than `engine`'s."""
    recorded = metadata.get(FINGERPRINT)
    if recorded and recorded != engine.fingerprint.id:
        raise mismatch(engine, recorded, metadata.get(MODEL), where)
