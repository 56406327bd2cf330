"""Generation settings and their validation, in one place.

Every choice a caller can make about how tokens are produced is named and checked here, once,
where the setting is made (a `GenerationConfig`, a `SpeculationConfig`, an engine's recovery);
the code below that trusts the values it is given. Nothing here imports the rest of the
package.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence, TypeVar

MODES = ("turbo", "naive")  # reuse chunk blobs, or prefill everything (the baseline)
QUANTIZE_MODES = (None, "int8", "bf16")
DRAFT_MODES = (None, "int8", "bf16")
RESIDUALS = ("rapid", "standard")
SPECULATION_POLICIES = ("auto", "always")
# What a turbo request that names no recovery recomputes at query time (core/prefill/recovery.py;
# chosen on the hand-written dev set, docs/accuracy.md), and the spellings a recovery takes.
DEFAULT_RECOVERY = "select:0.15"
RECOVERY_HELP = ("none | select:RATIO (e.g. select:0.15) | select:auto[:LOW-HIGH] | first[:K] | "
                 "boundary:K | blend:RATIO[@LAYER] | several joined by ','")


def check_choice(name: str, value, allowed: Sequence):
    """`value` if it is one of `allowed`, else a ValueError that names the setting and the
    choices."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, not {value!r}")
    return value


Config = TypeVar("Config")


def with_fields(config: Config, what: str, **changes: Any) -> Config:
    """`config` (a dataclass) with the named fields replaced and validated again; a name it
    does not have is a TypeError that names the ones it has. `what` names the settings in it."""
    names = [f.name for f in dataclasses.fields(config)]  # type: ignore[arg-type]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise TypeError(f"unknown {what} setting(s) {', '.join(map(repr, unknown))}; the "
                        f"settings are: {', '.join(sorted(names))}")
    return dataclasses.replace(config, **changes) if changes else config  # type: ignore


@dataclass
class GenerationConfig:
    """How to pick tokens. temperature 0 means greedy (the default).

    quantize="int8" decodes with int8 dynamic-quantised copies of the Linear layers (CPU, float32
    llama-family models; prefill stays full precision): about 1.8x faster steps, but greedy
    answers drift from full precision on small models (see core/decode/fast.py); "bf16" keeps
    answers close and, on CPUs with native bf16 (AVX512-BF16), steps about 1.5x faster. None
    (default) keeps the model's weights.

    draft="int8" (or "bf16") keeps the answers of full precision and still decodes faster: a
    quantised copy drafts `draft_tokens` tokens, the model verifies them in one forward and keeps
    what it agrees with (self-speculative decoding, core/decode/selfspec.py). Greedy output
    equals the full-precision output up to the rounding of a multi-token forward; sampling
    follows the model's own distribution. Same model requirements as quantize; falls back to
    plain decoding (with a warning) where the quantised copy cannot be built.

    ignore_eos=True decodes max_new_tokens tokens, end-of-sequence tokens included, as vLLM's
    `ignore_eos`: for benchmarks and checks in which every request must do the same work.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] = ()
    quantize: str | None = None
    draft: str | None = None
    draft_tokens: int = 4
    ignore_eos: bool = False

    def __post_init__(self):
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be ≥ 0")
        if not self.temperature >= 0 or self.temperature == float("inf"):  # NaN too
            raise ValueError("temperature must be a finite number ≥ 0 (0 = greedy)")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise ValueError("seed must fit in 64 bits (from -2**63 to 2**64 - 1)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be ≥ 0 (0 = no limit)")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(s for s in self.stop if s)
        check_choice("quantize", self.quantize, QUANTIZE_MODES)
        check_choice("draft", self.draft, DRAFT_MODES)
        if self.draft and self.quantize:
            raise ValueError("choose draft (quantised drafts, full-precision answers) or quantize "
                             "(quantised answers), not both")
        if self.draft_tokens < 1:
            raise ValueError("draft_tokens must be ≥ 1")

    @classmethod
    def from_options(cls, *layers: dict) -> "GenerationConfig":
        """The config of a framework's call: `layers` of options, later ones winning (e.g. a
        model's fields, then the call's arguments), each by GenerationConfig's names or the
        OpenAI-style `max_tokens`; None means "not given". The one translation every surface
        uses (LlamaIndex, LangChain, the server); a name it does not know is a TypeError."""
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict = {}
        for layer in layers:
            for name, value in layer.items():
                name = "max_new_tokens" if name == "max_tokens" else name
                if name not in known:
                    raise TypeError(f"{name!r} is not a generation setting; the settings are: "
                                    f"max_tokens, {', '.join(sorted(known))}")
                if value is not None:
                    values[name] = value
        return cls(**values)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def end_ids(self, eos_ids):
        """The token ids that end a generation under this config: `eos_ids`, or none at all
        with ignore_eos."""
        return frozenset() if self.ignore_eos else eos_ids


@dataclass(frozen=True)
class SpeculationConfig:
    """RAPID's verification rounds (core/rapid).

    gamma: drafts per round (≥ 1); eta: weight of the drafter's distribution in the target's
    (finite, ≥ 0; 0 is lossless); residual: where a rejected position draws from — "rapid" (the
    paper's norm(max(p − p̂, p − q, 0))) or "standard" (norm(max(p̂ − q, 0)), output follows p̂).
    min_draft_prob: adaptive draft length — a round stops drafting once the drafter's
    probability of its own last draft falls below this (0: always draft γ); it reads only the
    drafter's distribution, so the output law is unchanged. verify_split: verify with the
    split attention over the long cache (core/attention.py) where it applies. policy: "auto"
    speculates only where the measured costs predict a gain, with the best γ up to `gamma`
    for them, and decodes with the target alone elsewhere (core/rapid/policy.py); "always"
    drafts `gamma` every round.
    """

    gamma: int = 10
    eta: float = 0.0
    residual: str = "rapid"
    min_draft_prob: float = 0.0
    verify_split: bool = True
    policy: str = "auto"

    def __post_init__(self):
        if not isinstance(self.gamma, int) or self.gamma < 1:
            raise ValueError(f"gamma must be an integer ≥ 1, not {self.gamma!r}")
        if not 0 <= self.eta < float("inf"):  # also refuses NaN
            raise ValueError(f"eta must be a finite number ≥ 0 (0 is lossless), not {self.eta!r}")
        check_choice("residual", self.residual, RESIDUALS)
        check_choice("policy", self.policy, SPECULATION_POLICIES)
        if not 0.0 <= self.min_draft_prob < 1.0:  # also refuses NaN
            raise ValueError(f"min_draft_prob must be in [0, 1), not {self.min_draft_prob!r} "
                             "(0: always draft γ)")
