"""What the connector's scheduler knows of the served model, read from its checkpoint folder.

To find blobs the scheduler needs their fingerprints, the tokenizer, the anchor and the encoder
— not the model: the fingerprints come from the checkpoint files (core/checkpoint.py, equal to
the HF engine's). Only prompt heads and stock separators that no one stored yet must be
computed, and for those an HF copy of the model is loaded, on first need: a store that already
holds the heads and separators of the prompts it serves never makes the scheduler load it.
A model given as a hub id rather than a folder is loaded at once, as the fingerprint needs it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from ..core.checkpoint import fingerprint_checkpoint
from ..core.kv.blob import PLAIN, Fingerprint
from ..core.prefill.anchor import anchor_ids
from ..core.prefill.chunk_encoder import chunk_encoding, chunk_token_ids
from ..core.prefill.encoding import resolve_encoder
from ..core.prefill.separators import separator_ids
from ..core.store import KVStore
from .config import ConnectorConfig

log = logging.getLogger("turborag.vllm")


class ModelSetup:
    """The served model's tokenizer, blob fingerprints, anchor and encoder; its HF engine (for
    heads and separators) made when `engine` is first read."""

    def __init__(self, model: str, dtype: torch.dtype | str, config: ConnectorConfig,
                 store: KVStore):
        self._model, self._encoder, self._store = model, config.encoder, store
        self._dtype = str(dtype).replace("torch.", "")
        self._engine = None
        self._unusable = ""
        self._lock = threading.Lock()
        self.anchor = config.anchor
        self.context_tokens = config.context_tokens
        folder = Path(model)
        if not (folder.is_dir() and any(folder.glob("*.safetensors"))):
            self._adopt(self._load())  # a hub id or another format: fingerprint the model
            return
        from transformers import AutoConfig, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        config = AutoConfig.from_pretrained(folder)
        model_fp = fingerprint_checkpoint(folder, self._dtype, model, self.tokenizer, config)
        self.learned = resolve_encoder(self._encoder, model, model_fp.weights)
        if self.learned is not None:
            self.learned.check_model(model_fp.weights, model_fp.tokenizer, self.anchor or "none")
        self.anchor_ids = anchor_ids(self.anchor, self.tokenizer)
        self.chunk_fp = model_fp.with_encoding(
            chunk_encoding(self.anchor_ids, self.learned, self.context_tokens))
        self.prefix_fp = model_fp.with_encoding(PLAIN)
        window = int(config.max_position_embeddings)
        soft = self.learned.num_soft if self.learned is not None else 0
        self.max_chunk_tokens = window - len(self.anchor_ids) - soft

    def _load(self):
        from ..core.engine import TurboRAGEngine

        log.info("TurboRAG: loading an HF copy of %s (%s) for prompt heads and separators",
                 self._model, self._dtype)
        return TurboRAGEngine(self._model, dtype=self._dtype, store=self._store,
                              encoder=self._encoder,
                              anchor=self.anchor, context_tokens=self.context_tokens,
                              progress=False)

    def _adopt(self, engine) -> None:
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.learned = engine.learned
        self.anchor_ids = engine.library.encoder.anchor_ids
        self.chunk_fp: Fingerprint = engine.fingerprint
        self.prefix_fp: Fingerprint = engine.library.prefix_fingerprint
        self.max_chunk_tokens = engine.library.encoder.max_chunk_tokens

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    @property
    def engine(self):
        """The HF engine, loaded now if it is not yet. Its blobs must be the ones the
        checkpoint's fingerprints name, or they would be stored where nothing looks."""
        with self._lock:
            if self._engine is None:
                if self._unusable:  # loaded once and refused: not again for every head
                    raise RuntimeError(self._unusable)
                engine = self._load()
                if (engine.fingerprint.id, engine.library.prefix_fingerprint.id) != \
                        (self.chunk_fp.id, self.prefix_fp.id):
                    self._unusable = (
                        "the model loaded from the checkpoint fingerprints otherwise than its "
                        f"files ({engine.fingerprint.describe()} against "
                        f"{self.chunk_fp.describe()}): its loading changes the weights, so "
                        "blobs it encodes would not be found")
                    log.warning("TurboRAG: %s", self._unusable)
                    raise RuntimeError(self._unusable)
                self._engine = engine
            return self._engine

    def tokenize_chunk(self, text: str) -> list[int]:
        """A chunk's token ids as ChunkEncoder keys them."""
        return chunk_token_ids(self.tokenizer, text, self.max_chunk_tokens)

    def separator_ids(self) -> list[list[int]]:
        return [list(ids) for ids in separator_ids(self.tokenizer)]
