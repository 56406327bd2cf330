"""What the HTTP app is configured with, validated once (`create_app(engine, config=...)`).

    app = create_app(engine, config=ServerConfig(max_batch=4, api_key="sk-..."))
    app = create_app(engine, max_batch=4, api_key="sk-...")            # the same, by field name
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.request import Request
from .keys import KeyFile

__all__ = ["ServerConfig", "MAX_BATCH", "MAX_QUEUE", "MAX_BODY_BYTES", "BODY_TIMEOUT_S"]

MAX_BATCH = 8
MAX_QUEUE = 64
MAX_BODY_BYTES = 8 * 2**20  # 8 MiB: a 32K-token prompt is ≈128 KB; ingestion batches are larger
BODY_TIMEOUT_S = 30.0  # to receive a whole body: 8 MiB at 2 Mbit/s
# RAPID keeps the last long context's KV and its chunks' blobs in the store's default namespace
# (core/rapid/engine.py), which no tenant may share.
NO_RAPID_FOR_TENANTS = ("RAPID is not served to tenants (a keys file): its caches are not split "
                        "by tenant")


@dataclass(frozen=True)
class ServerConfig:
    """model_name: the name clients must send as `model` (None: the engine's model).
    default_max_tokens: the limit of a completion that sets none (None: the rest of the context
    window). mode: "turbo", or "naive" to prefill every prompt whole (no reuse: the baseline),
    for requests that do not set `turborag_mode`. max_batch: requests decoded together.
    max_queue: requests that may wait for the model; more get a 429. max_body_bytes: larger
    bodies get a 413. body_timeout_s: a body not received whole within it gets a 408.

    api_key: when set, every /v1/ request must send `Authorization: Bearer <api_key>`. keys:
    instead of one key, a keys file of tenants' keys (keys.py): each request works in its
    tenant's namespace of the store and index (service.py), /metrics needs an admin key and
    counts per tenant, and /health says only that the server is up.

    rapid_drafter: answer requests that ask for RAPID (`turborag_rapid`, server/rapid.py) with
    this drafter: a bundled name, a folder or a Hugging Face id, loaded like the served model
    onto its KV store, or "self" (the served model drafts for itself); None: no RAPID."""

    model_name: str | None = None
    default_max_tokens: int | None = None
    mode: str = "turbo"
    max_batch: int = MAX_BATCH
    max_queue: int = MAX_QUEUE
    max_body_bytes: int = MAX_BODY_BYTES
    body_timeout_s: float = BODY_TIMEOUT_S
    api_key: str | None = None
    keys: KeyFile | None = None
    rapid_drafter: str | None = None

    def __post_init__(self) -> None:
        Request("", mode=self.mode)  # the mode requests get by default: checked as theirs are
        for name in ("max_batch", "max_queue", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty: pass a key, or None to serve without one")
        if self.api_key is not None and self.keys is not None:
            raise ValueError("serve one API key or a keys file of tenants, not both")
        if self.rapid_drafter is not None and not self.rapid_drafter.strip():
            raise ValueError('the RAPID drafter is empty: name a model, or "self" for the '
                             "served model")
        if self.rapid_drafter is not None and self.keys is not None:
            raise ValueError(NO_RAPID_FOR_TENANTS)

    @property
    def tenants(self) -> bool:
        return self.keys is not None
