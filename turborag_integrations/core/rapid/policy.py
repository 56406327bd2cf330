"""When speculation pays, and with how many drafts: RAPID's cost model and its automatic policy.

A round drafts γ tokens (γ drafter steps) and verifies them in one target forward; with a
per-draft acceptance probability α the round yields on average

    E(γ, α) = (1 − α^(γ+1)) / (1 − α)      tokens (the accepted drafts and the target's own),

where the target alone would take E target steps. So speculation's predicted speed-up is

    S(γ) = E(γ, α) · step / (γ · draft + verify(γ)),    verify(γ) = step + extra · γ,

with `step` the target's one-token step at this context, `draft` the drafter's step at its own
context and `extra` what each verified draft adds to the target's forward (little on a CPU, where
the weights are read once for all of them). Every term is measured on this machine, in the
answers themselves: the rounds time their drafting and verification, a plain target step times
itself, and α is counted from the drafts tested (each up to the first rejection).

`SpeculationPolicy` ("auto", the default) decides before every round: the γ in 1..γ_max with the
best S, or a plain target step where no γ predicts S ≥ 1 + `MARGIN`. With nothing measured yet
at this context length, an answer starts with one plain step (to time `step`) and one small
round (`PROBE_GAMMA` drafts, to time drafting and verification cheaply); once speculation
predicts a loss it stays off for the rest of the answer. What was measured is kept per context
length (powers of two) for the engine's next answers, so a second answer decides at once; every
`REPROBE_EVERY`-th answer at a length probes once more, so that timings taken while the machine
was busy do not decide that length for good. The
output law is untouched: a plain step is the target's own, and a round of any γ is lossless at
η = 0. "always" keeps the fixed γ of every round, for experiments.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from ..settings import SPECULATION_POLICIES as POLICIES

__all__ = ["SpeculationPolicy", "CostTable", "expected_tokens", "predicted_speedup",
           "POLICIES"]

MARGIN = 0.05  # speculate only where the prediction beats the target alone by this much
PROBE_GAMMA = 2  # drafts of the first round at an unmeasured length: cheap if it does not pay
PRIOR = (1.0, 1.0)  # Beta prior on α: (accepted, rejected) pseudo-counts
# Every this many answers at a length where speculation was judged a loss, one probe round
# again: timings taken on a busy machine must not switch it off there for good.
REPROBE_EVERY = 8
SMOOTH = 0.3  # weight of a new timing in the running means


def expected_tokens(gamma: int, alpha: float) -> float:
    """Tokens a round of `gamma` drafts yields on average at per-draft acceptance `alpha`."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def predicted_speedup(gamma: int, alpha: float, step: float, draft: float,
                      extra: float) -> float:
    """S(γ) of the module docstring: speculation's decode speed over the target alone's."""
    cost = gamma * draft + step + extra * gamma
    return expected_tokens(gamma, alpha) * step / cost if cost > 0 else 0.0


@dataclass
class Costs:
    """Running measurements at one context length (seconds; None: not measured yet)."""

    step: float | None = None
    draft: float | None = None
    extra: float | None = None
    accepted: float = 0.0
    rejected: float = 0.0
    answers: int = 0  # answers begun at this length

    @property
    def alpha(self) -> float:
        a, r = PRIOR
        return (self.accepted + a) / (self.accepted + self.rejected + a + r)

    @property
    def known(self) -> bool:
        return None not in (self.step, self.draft, self.extra)


def _mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTH) * old + SMOOTH * new


class CostTable:
    """An engine's measurements by target context length (rounded up to a power of two), kept
    across its answers; thread-safe."""

    def __init__(self):
        self._by_length: dict[int, Costs] = {}
        self._lock = threading.Lock()

    @staticmethod
    def bucket(context_tokens: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(context_tokens, 1))))

    def at(self, context_tokens: int) -> Costs:
        with self._lock:
            return self._by_length.setdefault(self.bucket(context_tokens), Costs())


@dataclass
class SpeculationPolicy:
    """The decisions of one answer (see the module docstring): `gamma_for(room)` before each
    round (0: a plain target step), `observe(...)` after it."""

    mode: str
    max_gamma: int
    costs: Costs = field(default_factory=Costs)
    off: bool = False  # speculation predicted a loss: the rest of the answer is plain steps
    predicted: float | None = None  # S of the last decision that speculated or stopped
    decisions: list[int] = field(default_factory=list)  # γ of each round, 0 for a plain step

    def __post_init__(self) -> None:
        self.costs.answers += 1

    def gamma_for(self, room: int) -> int:
        """Drafts for the next round, at most `room` (0: a plain target step)."""
        gamma = self._choose()
        gamma = max(0, min(gamma, room))
        self.decisions.append(gamma)
        return gamma

    def _choose(self) -> int:
        if self.mode == "always":
            return self.max_gamma
        if self.off:
            return 0
        c = self.costs
        if c.step is None:
            return 0  # time the target's own step first
        if c.draft is None or c.extra is None:
            return min(PROBE_GAMMA, self.max_gamma)
        if not self.decisions and c.answers % REPROBE_EVERY == 0:
            return min(PROBE_GAMMA, self.max_gamma)  # this answer's first round: look again
        best = max(range(1, self.max_gamma + 1),
                   key=lambda g: predicted_speedup(g, c.alpha, c.step, c.draft, c.extra))
        self.predicted = predicted_speedup(best, c.alpha, c.step, c.draft, c.extra)
        if self.predicted < 1.0 + MARGIN:
            self.off = True
            return 0
        return best

    def observe(self, drafted: int, accepted: int, draft_s: float, draft_steps: int,
                verify_s: float) -> None:
        """What a round cost and how many of its drafts the target accepted."""
        c = self.costs
        if drafted == 0:  # a plain target step
            c.step = _mean(c.step, verify_s)
            return
        if draft_steps:
            c.draft = _mean(c.draft, draft_s / draft_steps)
        if c.step is not None:
            c.extra = _mean(c.extra, max(0.0, (verify_s - c.step) / drafted))
        c.accepted += accepted
        c.rejected += 1 if accepted < drafted else 0

    def as_dict(self) -> dict:
        spec = [g for g in self.decisions if g]
        return {"policy": self.mode,
                "speculated_rounds": len(spec),
                "plain_steps": len(self.decisions) - len(spec),
                "mean_gamma": sum(spec) / len(spec) if spec else 0.0,
                "predicted_speedup": self.predicted,
                "switched_off": self.off,
                "alpha": self.costs.alpha}
