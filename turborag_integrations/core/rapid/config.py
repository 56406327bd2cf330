"""RapidEngine's configuration: the verification rounds and the drafter's own context.

    RapidEngine(target, drafter, config=RapidConfig(speculation=SpeculationConfig(gamma=4)))
    RapidEngine(target, drafter, gamma=4, max_drafter_tokens=2048)     # the same, by field name

The engine's flat keywords are the fields of `RapidConfig` and of its `SpeculationConfig`
(core/settings.py), routed by `RapidConfig.with_settings`; each dataclass validates its own
fields, so a config that exists is valid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..settings import QUANTIZE_MODES, SpeculationConfig, check_choice

__all__ = ["RapidConfig"]


@dataclass(frozen=True)
class RapidConfig:
    """speculation: γ, η, the residual, the adaptive draft length (`SpeculationConfig`).

    chunk_tokens, threshold, max_drafter_tokens, compression, min_drafter_tokens: the drafter's
    own retrieval from the long context — chunks of chunk_tokens; cosine ≥ threshold; best first
    within a budget of max(min_drafter_tokens, min(max_drafter_tokens, |context| / compression))
    tokens, never more than the context (max_drafter_tokens None: no cap); kept in document
    order. `REFERENCE_CONTEXT` (core/rapid/engine.py) is the reference code's setting.

    prefix_cache: keep the target's KV of the last long context, so that another question over
    it prefills only the question. drafter_quantize: "int8" or "bf16" runs the drafter's steps
    on reduced-precision weights (decode/fast.py); the target always decodes in its own
    precision."""

    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)
    chunk_tokens: int = 512
    threshold: float = 0.3
    max_drafter_tokens: int | None = 4096
    compression: float = 4.0
    min_drafter_tokens: int = 0
    prefix_cache: bool = True
    drafter_quantize: str | None = None

    def __post_init__(self) -> None:
        check_choice("drafter_quantize", self.drafter_quantize, QUANTIZE_MODES)
        if not self.compression > 0 or self.chunk_tokens < 1 or self.min_drafter_tokens < 0 \
                or (self.max_drafter_tokens is not None and self.max_drafter_tokens < 1):
            raise ValueError("compression must be > 0, chunk_tokens and max_drafter_tokens ≥ 1 "
                             "(or max_drafter_tokens None), min_drafter_tokens ≥ 0")

    @staticmethod
    def setting_names() -> list[str]:
        own = [f.name for f in dataclasses.fields(RapidConfig) if f.name != "speculation"]
        return sorted(own + [f.name for f in dataclasses.fields(SpeculationConfig)])

    def with_settings(self, **settings: Any) -> "RapidConfig":
        """This config with the named fields replaced (a speculation field in `speculation`)."""
        unknown = sorted(set(settings) - set(self.setting_names()))
        if unknown:
            raise TypeError(f"unknown RAPID setting(s) {', '.join(map(repr, unknown))}; the "
                            f"settings are: {', '.join(self.setting_names())}")
        rounds = {f.name for f in dataclasses.fields(SpeculationConfig)}
        spec = {k: v for k, v in settings.items() if k in rounds}
        own = {k: v for k, v in settings.items() if k not in rounds}
        if spec:
            own["speculation"] = dataclasses.replace(self.speculation, **spec)
        return dataclasses.replace(self, **own) if own else self
