"""What an engine is configured with: one dataclass per concern, validated once, passed whole.

    config = EngineConfig(encoding=EncodingConfig(context_tokens=0),
                          query=QueryConfig(recovery="select:0.2"))
    engine = TurboRAGEngine("qwen2.5-coder-0.5b-instruct", config=config)
    engine = TurboRAGEngine("qwen2.5-coder-0.5b-instruct", context_tokens=0,
                            recovery="select:0.2")  # the same, by field name

- `ModelConfig` (core/models.py): where and in what precision the model runs, and what
  transformers' `from_pretrained` is given besides.
- `EncodingConfig`: how a chunk becomes a blob at ingestion. Every field is part of the blobs'
  fingerprint or key, so blobs made under one never answer for another.
- `QueryConfig`: how a turbo request is stitched and recovered at query time. Nothing here
  touches a stored blob: two engines that differ only here share a store.
- `AdmissionConfig` (core/admission.py): which chunks get a blob — all at ingestion, or a hot
  set encoded in the background on a chunk's k-th retrieval.

The engine's flat keywords (`TurboRAGEngine(context_tokens=0)`) are the fields of these
dataclasses, routed by `EngineConfig.with_settings` to the concern that owns them, as vLLM's
`LLM(**kwargs)` are its `EngineArgs`; an unknown one is refused with the list of known ones.
Each dataclass checks its own fields in `__post_init__`, so a config that exists is valid and
the code below trusts it. Adding a knob is one field here and its one use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .admission import AdmissionConfig
from .models import ModelConfig
from .prefill.anchor import DEFAULT_ANCHOR
from .prefill.context import DEFAULT_CONTEXT_TOKENS
from .prefill.encoding import LearnedEncoding
from .prefill.recovery import NO_RECOVERY, Recovery, parse_recovery
from .settings import DEFAULT_RECOVERY

__all__ = ["AdmissionConfig", "EngineConfig", "EncodingConfig", "ModelConfig", "QueryConfig"]


@dataclass(frozen=True)
class EncodingConfig:
    """anchor: what each chunk is encoded after — "chat" (default), "bos", "none" or a text
    (core/prefill/anchor.py).

    encoder: learned parameters that act only while chunks are encoded (core/prefill/encoding.py):
    "default" loads the file shipped for a bundled model (none for other models), a path or a
    bundled model's name loads that file, None keeps the training-free encoding. Query-time
    weights stay as loaded, so full prefills answer exactly as the unmodified model does.

    context_tokens: encode each chunk after up to this many tokens of its document's text before
    it (the context's KV discarded); 0 encodes chunks alone (core/prefill/context.py).

    prompt_heads: template heads each chunk is also encoded after (a lead blob per head), so that
    the first chunk of a prompt with that head is stitched as a full prefill computes it.

    batch_size: chunks per encoding forward at ingestion (and at most `BATCH_TOKENS`, 2,048, tokens
    of chunk and context: core/prefill/chunk_encoder.py)."""

    anchor: str = DEFAULT_ANCHOR  # None is taken as "none"
    encoder: str | Path | LearnedEncoding | None = "default"
    context_tokens: int = DEFAULT_CONTEXT_TOKENS
    prompt_heads: tuple[str, ...] = ()
    batch_size: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(self, "anchor", self.anchor or "none")
        if isinstance(self.prompt_heads, str):
            raise ValueError("prompt_heads is a sequence of template heads, not one string: "
                             f"pass ({self.prompt_heads!r},)")
        object.__setattr__(self, "prompt_heads", tuple(self.prompt_heads))
        if any(not isinstance(h, str) or not h for h in self.prompt_heads):
            raise ValueError("each prompt head must be a non-empty string")
        if not isinstance(self.context_tokens, int) or self.context_tokens < 0:
            raise ValueError(f"context_tokens must be an integer ≥ 0 (0 encodes chunks alone), "
                             f"not {self.context_tokens!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer ≥ 1, not {self.batch_size!r}")


@dataclass(frozen=True)
class QueryConfig:
    """recovery: what a turbo request that names none of its own recomputes at query time
    (core/prefill/recovery.py): "select:0.15" (the default), "none", or any spec
    `parse_recovery` reads; held parsed, so a bad spec fails here, before any model loads.

    question_last: move a question-first prompt's chunks in front of the user's text before them
    (core/prefill/reorder.py); changes the prompt, so off by default.

    separators: stitch the stock separator between chunks from its stored blob, as vLLM's
    connector must; False prefills it with the rest of the prompt.

    cache_prefix: keep the KV of a prompt's text before its first chunk (a template head) for
    the next request with the same head. prefetch: read a prompt's blobs concurrently."""

    recovery: Recovery = field(default=DEFAULT_RECOVERY)  # type: ignore[assignment]
    question_last: bool = False
    separators: bool = True
    cache_prefix: bool = True
    prefetch: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "recovery", parse_recovery(self.recovery) or NO_RECOVERY)


_CONCERNS = {"model": ModelConfig, "encoding": EncodingConfig, "query": QueryConfig,
             "admission": AdmissionConfig}


@dataclass(frozen=True)
class EngineConfig:
    """An engine's whole configuration: the model, the encoding, the query-time stitching,
    which chunks get a blob."""

    model: ModelConfig = field(default_factory=ModelConfig)
    encoding: EncodingConfig = field(default_factory=EncodingConfig)
    query: QueryConfig = field(default_factory=QueryConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)

    @staticmethod
    def setting_names() -> dict[str, str]:
        """Each flat setting's name → the concern that owns it."""
        return {f.name: concern for concern, cls in _CONCERNS.items()
                for f in dataclasses.fields(cls)}

    def with_settings(self, **settings: Any) -> "EngineConfig":
        """This config with the named fields replaced, each in the concern that owns it (and
        validated there)."""
        if not settings:
            return self
        owners = self.setting_names()
        unknown = sorted(set(settings) - set(owners))
        if unknown:
            raise TypeError(f"unknown engine setting(s) {', '.join(map(repr, unknown))}; the "
                            f"settings are: {', '.join(sorted(owners))}")
        changes: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            changes.setdefault(owners[name], {})[name] = value
        return dataclasses.replace(self, **{
            concern: dataclasses.replace(getattr(self, concern), **values)
            for concern, values in changes.items()})
