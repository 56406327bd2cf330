"""KV blobs: one chunk's keys and values, computed alone at positions 0..n−1.

A blob is only valid for the exact model weights, tokenizer and dtype that made it (invariant 3),
so every blob carries a fingerprint of all three plus the format version, and every use checks it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import torch

from .errors import EmptyChunkError, FingerprintMismatch

FORMAT_VERSION = 1

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

    @property
    def id(self) -> str:
        """The compared identity: everything but the display name."""
        return _digest(f"{self.config}|{self.weights}|{self.tokenizer}|{self.dtype}|{self.format}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Fingerprint":
        return cls(**json.loads(text))

    def describe(self) -> str:
        return (f"model={self.model} config={self.config[:8]} weights={self.weights[:8]} "
                f"tokenizer={self.tokenizer[:8]} dtype={self.dtype} format={self.format}")

    def check_matches(self, other: "Fingerprint", what: str = "KV blob") -> None:
        if self.id != other.id:
            differing = [f for f in ("config", "weights", "tokenizer", "dtype", "format")
                         if getattr(self, f) != getattr(other, f)]
            raise FingerprintMismatch(
                f"{what} was made by another model setup (differs in {', '.join(differing)}):\n"
                f"  blob:   {other.describe()}\n  engine: {self.describe()}\n"
                "Re-encode the chunks with this model (or load the model the blobs were made with)."
            )


def fingerprint_model(model, tokenizer, name: str) -> Fingerprint:
    config = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    config_hash = _digest(json.dumps(config, sort_keys=True, default=str))
    # Hashing all weights would cost seconds on load; a few whole tensors from both ends of the
    # network tell any two trainings of one architecture apart.
    params = dict(model.named_parameters())
    names = sorted(params)
    sample = [names[0], names[len(names) // 2], names[-1]]
    weights = hashlib.blake2b(digest_size=16)
    for n in sample:
        weights.update(n.encode())
        weights.update(params[n].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    vocab = sorted(tokenizer.get_vocab().items())
    specials = sorted(map(str, getattr(tokenizer, "all_special_tokens", [])))
    tok_hash = _digest(json.dumps([type(tokenizer).__name__, vocab, specials]))
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    return Fingerprint(model=name, config=config_hash, weights=weights.hexdigest(),
                       tokenizer=tok_hash, dtype=dtype)


def chunk_key(fingerprint: Fingerprint, token_ids: Sequence[int]) -> str:
    """Content address of a chunk for one model setup: same tokens + same setup → same key."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()
    return _digest(fingerprint.id.encode() + b"|" + ids, size=20)


@dataclass
class KVBlob:
    """Keys and values of one chunk: [layers, kv_heads, tokens, head_dim] each."""

    token_ids: torch.Tensor  # int64 [tokens]
    keys: torch.Tensor
    values: torch.Tensor
    fingerprint: Fingerprint

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


ProgressFn = Callable[[int, int], None]  # (done, total)


class ChunkEncoder:
    """Encodes chunks of text into KV blobs with the stock model, in batches."""

    def __init__(self, model, tokenizer, fingerprint: Fingerprint, *, batch_size: int = 8,
                 max_chunk_tokens: int | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.batch_size = batch_size
        self.max_chunk_tokens = max_chunk_tokens or int(model.config.max_position_embeddings)

    def tokenize(self, text: str) -> list[int]:
        if not text or not text.strip():
            raise EmptyChunkError("cannot encode an empty chunk: give it some text (whitespace "
                                  "alone has nothing to cache)")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise EmptyChunkError(f"chunk {text[:40]!r} produced no tokens")
        if len(ids) > self.max_chunk_tokens:
            raise EmptyChunkError(
                f"chunk of {len(ids)} tokens exceeds the model's window of "
                f"{self.max_chunk_tokens}; split it into smaller chunks")
        return ids

    def encode(self, text: str) -> KVBlob:
        return self.encode_many([text])[0]

    def encode_ids(self, ids_list: Sequence[Sequence[int]],
                   progress: ProgressFn | None = None) -> list[KVBlob]:
        """Encode token-id chunks. Right padding keeps every real token at its own position
        0..n−1, and causal attention means no real token ever sees a pad."""
        order = sorted(range(len(ids_list)), key=lambda i: len(ids_list[i]))  # less padding
        blobs: list[KVBlob | None] = [None] * len(ids_list)
        device = next(self.model.parameters()).device
        pad_id = self.tokenizer.pad_token_id
        pad_id = 0 if pad_id is None else pad_id
        done = 0
        for start in range(0, len(order), self.batch_size):
            batch = order[start:start + self.batch_size]
            lengths = [len(ids_list[i]) for i in batch]
            width = max(lengths)
            input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                input_ids[row, :lengths[row]] = torch.as_tensor(ids_list[i])
                mask[row, :lengths[row]] = 1
            with torch.inference_mode():
                out = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                 use_cache=True, logits_to_keep=1)
            cache = out.cache
            keys = torch.stack([layer.keys for layer in cache.layers], dim=1)  # [B, L, H, T, D]
            values = torch.stack([layer.values for layer in cache.layers], dim=1)
            for row, i in enumerate(batch):
                n = lengths[row]
                blobs[i] = KVBlob(
                    token_ids=torch.as_tensor(ids_list[i], dtype=torch.long),
                    keys=keys[row, :, :, :n].contiguous().cpu(),
                    values=values[row, :, :, :n].contiguous().cpu(),
                    fingerprint=self.fingerprint,
                )
            done += len(batch)
            if progress:
                progress(done, len(ids_list))
        return blobs  # type: ignore[return-value]

    def encode_many(self, texts: Iterable[str], progress: ProgressFn | None = None) -> list[KVBlob]:
        return self.encode_ids([self.tokenize(t) for t in texts], progress=progress)
