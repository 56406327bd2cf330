"""Errors the package raises on purpose; each message says what was wrong and what to do."""


class TurboRAGError(Exception):
    """Base class of every error this package raises on purpose."""


class ModelError(TurboRAGError):
    """A model cannot be found, verified or used."""


class UnsupportedRopeError(ModelError):
    """The model's RoPE variant cannot be re-rotated exactly."""


class FingerprintMismatch(TurboRAGError):
    """A KV blob was made by another model, tokenizer, dtype or format."""


class ContextWindowError(TurboRAGError):
    """A prompt does not fit the model's context window."""


class EmptyChunkError(TurboRAGError, ValueError):
    """A chunk with no text (or no tokens) was given for encoding."""


class BlobCorrupted(TurboRAGError):
    """A stored blob failed its checksum or could not be parsed."""


class EncoderMismatch(ModelError):
    """A learned chunk-encoder file that was not made for this model, tokenizer or anchor."""
