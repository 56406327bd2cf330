"""One generation as a caller asks for it, and the same generation once its prompt is prefilled.

Every run path takes a prompt to its first token the same way: `engine.stream` on the caller's
thread, `BatchScheduler` on its worker, RAPID for its target and drafter. The pieces they share
live here, each once: the request's fields, how many cache slots a prefill reserves for what
decoding writes after it, and how many new tokens the context window leaves.

    request = Request(prompt, chunks=("…",), config=GenerationConfig(max_new_tokens=64))
    prepared = engine.start(request)        # split, stitch and prefill; the stats filled in
    prepared.prefill.logits, prepared.limit, prepared.stats.ttft_s
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .prefill.recovery import Recovery, parse_recovery
from .prefill.stitch import Prefill, Segment
from .run import GenerationStats
from .settings import MODES, GenerationConfig, check_choice

__all__ = ["Prepared", "Request", "new_token_limit", "reserve_slots"]


@dataclass(frozen=True)
class Request:
    """What to generate: the arguments of `TurboRAGEngine.stream`, held together.

    prompt: the prompt text, or segments ready to prefill (turbo mode stitches their blobs;
    naive mode prefills their text). chunks: the retrieved texts the prompt may contain.
    mode: "turbo" or "naive" (a full prefill). recovery: a per-call override of the engine's
    (None: the engine's), a `Recovery` or a spec `parse_recovery` reads. namespace, shared: the
    store namespace (a tenant) whose blobs the prompt reuses (None: the engine's own), and the
    namespaces it may also read (`TurboRAGEngine.namespaced`); a batch scheduler answers it on
    that view of its engine.

    Made once where a caller's request enters the package (an adapter, the server, the CLI) and
    handed whole from there to the prefill: the mode is checked and the recovery parsed here,
    so every hop after trusts them."""

    prompt: str | Sequence[Segment]
    chunks: tuple[str, ...] = ()
    config: GenerationConfig = field(default_factory=GenerationConfig)
    mode: str = "turbo"
    encode_missing: bool = False
    recovery: Recovery | None = None
    namespace: str | None = None
    shared: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        object.__setattr__(self, "chunks", tuple(self.chunks))
        object.__setattr__(self, "recovery", parse_recovery(self.recovery))
        object.__setattr__(self, "shared", tuple(self.shared))


@dataclass
class Prepared:
    """A request whose prompt is prefilled: its cache and first logits, its stats so far, and
    how many new tokens it may have."""

    request: Request
    prefill: Prefill
    stats: GenerationStats
    limit: int

    @property
    def position(self) -> int:
        """Where the first new token goes."""
        return self.prefill.plan.next_position


def reserve_slots(new_tokens: int, drafted: int = 0) -> int:
    """Cache slots a prefill keeps free for decoding after it: one per new token, plus the
    `drafted` tokens a speculative round writes past the accepted ones before verification cuts
    them off (a self-drafting round: its draft tokens and the pending one)."""
    return new_tokens + drafted


def new_token_limit(max_new_tokens: int, context_window: int, prompt_tokens: int) -> int:
    """The most new tokens a prompt of `prompt_tokens` may have: `max_new_tokens`, clipped to
    the room the context window leaves."""
    return max(0, min(max_new_tokens, context_window - prompt_tokens))
