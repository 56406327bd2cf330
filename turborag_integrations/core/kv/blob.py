"""KV blobs: one chunk's keys and values, computed alone (optionally after a fixed anchor).

A blob is only valid for the exact model weights, tokenizer and dtype that made it (invariant 3),
and for the way it was encoded (invariant 7): every blob carries a fingerprint of all of these
plus the format version, and every use checks it.

How chunks become blobs (`ChunkEncoder`, anchored encoding) is core/prefill/chunk_encoder.py's.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from typing import Sequence

import torch
import xxhash

from ..errors import FingerprintMismatch

FORMAT_VERSION = 1
PLAIN = "plain"

# Keys that describe where or how a config was saved rather than what the model computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "architectures", "dtype",
                         "torch_dtype", "_commit_hash", "_attn_implementation_autoset",
                         "attn_implementation", "_attn_implementation", "use_cache",
                         "output_attentions", "output_hidden_states", "return_dict"}


def _digest(payload: bytes | str, size: int = 16) -> str:
    if isinstance(payload, str):
        payload = payload.encode()
    return hashlib.blake2b(payload, digest_size=size).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """What a blob depends on. Two blobs mix only if their fingerprints are equal."""

    model: str  # name the model was loaded under, for messages only (not compared)
    config: str  # hash of the architecture config
    weights: str  # hash of a sample of the weights: distinguishes fine-tunes of one config
    tokenizer: str  # hash of vocabulary and special tokens
    dtype: str
    format: int = FORMAT_VERSION
    # How the blob's tokens were encoded: "plain" (alone at 0..n−1) or "anchor:<digest>" (after
    # that anchor's tokens). Blobs of different encodings never share a key.
    encoding: str = PLAIN

    @property
    def model_id(self) -> str:
        """The identity of the model setup alone: weights, tokenizer, dtype and format."""
        return _digest(f"{self.config}|{self.weights}|{self.tokenizer}|{self.dtype}|{self.format}")

    @property
    def id(self) -> str:
        """The compared identity: the model setup and the encoding, not the display name."""
        return _digest(f"{self.model_id}|{self.encoding}")

    def with_encoding(self, encoding: str) -> "Fingerprint":
        return replace(self, encoding=encoding)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Fingerprint":
        """Parse a stored fingerprint; raises ValueError (never TypeError) when it is not one."""
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"unreadable fingerprint: {exc}") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not {"config", "weights", "tokenizer", "dtype"} <= set(data):
            raise ValueError("fingerprint lacks config/weights/tokenizer/dtype")
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"fingerprint has unknown fields {sorted(unknown)} (a newer format?)")
        return cls(**data)

    def describe(self) -> str:
        return (f"model={self.model} config={self.config[:8]} weights={self.weights[:8]} "
                f"tokenizer={self.tokenizer[:8]} dtype={self.dtype} format={self.format} "
                f"encoding={self.encoding}")

    def check_matches(self, other: "Fingerprint", what: str = "KV blob") -> None:
        """Raise FingerprintMismatch unless `other` was made by this model setup (any encoding:
        a prompt legitimately mixes plain prefix blobs with anchored chunk blobs)."""
        if self.model_id != other.model_id:
            differing = [f for f in ("config", "weights", "tokenizer", "dtype", "format")
                         if getattr(self, f) != getattr(other, f)]
            raise FingerprintMismatch(
                f"{what} was made by another model setup (differs in {', '.join(differing)}):\n"
                f"  blob:   {other.describe()}\n  engine: {self.describe()}\n"
                "Re-encode the chunks with this model (or load the model the blobs were made with)."
            )


def weights_digest(model) -> str:
    """A digest of every parameter and buffer the model computes with.

    All of them: a LoRA merged into the attention and MLP projections changes nothing else, so
    any sample of tensors could miss it (and share the base model's blobs). xxh3 reads memory at
    several GB/s, so the 540 MB of SmolLM2 cost about 0.1 s.
    """
    h = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        digest_tensor(h, name, tensor.detach())
    return h.hexdigest()


def digest_tensor(h, name: str, tensor: torch.Tensor) -> None:
    """Add one named tensor to a weights digest: its name, dtype and bytes (core/checkpoint.py
    adds a checkpoint's tensors the same way, so that both digests agree)."""
    t = tensor if tensor.device.type == "cpu" else tensor.cpu()
    h.update(name.encode())
    h.update(str(t.dtype).encode())
    h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def fingerprint_model(model, tokenizer, name: str) -> Fingerprint:
    dtype = next(model.parameters()).dtype
    return fingerprint_parts(model.config, tokenizer, weights_digest(model), dtype, name)


def fingerprint_parts(config, tokenizer, weights: str, dtype, name: str) -> Fingerprint:
    """A fingerprint from its parts: an HF config, a tokenizer, a weights digest and the dtype
    (core/checkpoint.py builds the same one from a checkpoint folder, with no model)."""
    config = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_hash = _digest(json.dumps(config, sort_keys=True, default=str))
    vocab = sorted(tokenizer.get_vocab().items())
    specials = sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))
    tok_hash = _digest(json.dumps([type(tokenizer).__name__, vocab, specials]))
    return Fingerprint(model=name, config=config_hash, weights=weights, tokenizer=tok_hash,
                       dtype=str(dtype).replace("torch.", ""))


def namespace_tag(namespace: str) -> str:
    """The short tag that ends every key of a namespace ("" for the default namespace)."""
    return _digest(f"namespace|{namespace}", size=8) if namespace else ""


def chunk_key(fingerprint: Fingerprint, token_ids: Sequence[int], namespace: str = "") -> str:
    """Content address of a chunk for one model setup: same tokens + same setup → same key.

    In a namespace (a tenant, core/store/namespaces.py) the namespace is digested with the
    tokens and its tag ends the key ("<digest>-<tag>"): the same text has another key in every
    namespace, and a store of one namespace can tell a key of another by its tag."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()
    if not namespace:
        return _digest(fingerprint.id.encode() + b"|" + ids, size=20)
    salted = f"{fingerprint.id}|namespace|{namespace}|".encode() + ids
    return f"{_digest(salted, size=20)}-{namespace_tag(namespace)}"


@dataclass
class KVBlob:
    """Keys and values of one chunk: [layers, kv_heads, tokens, head_dim] each."""

    token_ids: torch.Tensor  # int64 [tokens]
    keys: torch.Tensor
    values: torch.Tensor
    fingerprint: Fingerprint
    # RoPE position the chunk's first token was encoded at: 0 alone, the anchor's length after
    # an anchor. Stitching rotates the keys by (position in the prompt − base_position).
    base_position: int = 0

    def __post_init__(self):
        n = self.token_ids.shape[0]
        if self.keys.shape != self.values.shape or self.keys.shape[2] != n:
            raise ValueError(f"inconsistent blob shapes: ids {tuple(self.token_ids.shape)}, "
                             f"keys {tuple(self.keys.shape)}, values {tuple(self.values.shape)}")

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def key(self) -> str:
        return chunk_key(self.fingerprint, self.token_ids.tolist())

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.token_ids.nbytes

    def head(self, n: int) -> "KVBlob":
        """The blob of the chunk's first n tokens: causal attention makes their keys and values
        independent of the tokens after them, so a view is exact."""
        if not 0 < n <= self.num_tokens:
            raise ValueError(f"a blob of {self.num_tokens} tokens has no head of {n}")
        if n == self.num_tokens:
            return self
        return KVBlob(self.token_ids[:n], self.keys[:, :, :n], self.values[:, :, :n],
                      self.fingerprint, self.base_position)
