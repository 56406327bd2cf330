"""One speculation: a drafter proposes γ tokens, the target verifies them in one forward.

`speculate` runs rounds over two `Side`s (a model, its cache and its next position) and yields
what each round produced; the acceptance rule is `decode.sampling.accept_drafts` (RAPID's
retrieval-augmented distribution, lossless at η = 0). The facade that prepares both sides from
a long context and its retrieved chunks is `rapid.engine.RapidEngine`.

Caches: the target cache holds the context and every accepted token but the last; the drafter
cache likewise, plus possibly the last accepted draft when a whole round was accepted. A round
feeds the pending tokens and drafts to both, then truncates both to what was accepted (O(1)),
so after any round each cache equals a fresh prefill of the accepted sequence.

Speed (measured in benchmarks/rapid.py): a round costs γ drafter steps plus one target forward
of the pending token and the drafts, which on a CPU costs little more than one target step
(the target's weights are read once for all of them). Two switches make drafting cheaper
without touching the target's arithmetic: the drafter side may step on reduced-precision
weights (`Side(quantize="int8")`, decode/fast.py), and a round may stop drafting early once the
drafter is unsure of its next token (`min_draft_prob`). Neither changes what the target accepts
at η = 0: every token is still the target's own choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

import torch

from ..attention import sdpa_gqa, suffix_causal
from ..decode.fast import FastDecoder, unsupported_reason
from ..decode.sampling import AcceptRule, accept_drafts, first_token, sample
from ..kv.cache import KVCache
from ..settings import GenerationConfig, SpeculationConfig
from ..transformers_api import with_cache
from .policy import SpeculationPolicy


@dataclass
class Side:
    """One model's state: its cache holds every accepted token except `pending`.

    `position` is the RoPE position of the next token fed (stitched caches need not have one
    position per cache entry, so it is tracked apart from the cache length).
    """

    model: object
    cache: KVCache
    logits: torch.Tensor  # next-token logits of the prefill
    position: int
    pending: list[int] = field(default_factory=list)
    fast: bool = True  # decode.FastDecoder where the model allows it, as the plain decode loop
    # reduced-precision weights for this side's steps ("int8", "bf16"; decode/fast.py): for a
    # drafter only, since the target's arithmetic decides the output
    quantize: str | None = None

    def __post_init__(self):
        # looked up once per generation, not per fed token (the support check walks the model)
        if self.quantize is not None:
            if not self.fast:
                raise ValueError(f"quantize={self.quantize!r} needs the fast decode path "
                                 "(fast=True)")
            self._decoder = FastDecoder.for_model(self.model, self.quantize)
            if self._decoder is None:
                raise ValueError(f"quantize={self.quantize!r}: the fast decode path does not "
                                 f"support this model ({unsupported_reason(self.model)})")
        else:
            self._decoder = FastDecoder.for_model(self.model) if self.fast else None

    def feed(self, tokens: Sequence[int], keep: int = 1, verify: bool = False) -> torch.Tensor:
        """Append `tokens` to the cache; return the logits of the last `keep` of them.

        verify: several tokens attend through the split attention of core/attention.py
        (the fast decoder always does); otherwise through SDPA with a mask (grouped-query on
        CPU). Both switches hold for this forward only: other threads using the same model are
        unaffected.
        """
        decoder = self._decoder if verify or len(tokens) == 1 or self.quantize else None
        if decoder is not None:
            with torch.inference_mode():
                logits = decoder.forward(tokens, self.position, self.cache)
            self.position += len(tokens)
            return logits[-keep:]
        device = self.cache.device
        ids = torch.tensor([list(tokens)], device=device)
        pos = torch.arange(self.position, self.position + len(tokens), device=device)[None]
        with torch.inference_mode(), suffix_causal(self.model, verify and len(tokens) > 1), \
                sdpa_gqa(device):
            out = self.model(input_ids=ids, position_ids=pos, **with_cache(self.cache), use_cache=True,
                             logits_to_keep=keep)
        self.position += len(tokens)
        return out.logits[0, -keep:]

    def truncate(self, length: int) -> None:
        """Keep the first `length` cache entries; the next position moves back with them."""
        drop = self.cache.length - length
        if drop > 0:
            self.cache.truncate(length)
            self.position -= drop


@dataclass
class Round:
    """What one speculative round produced (round 0 is the first token, from the prefills)."""

    tokens: list[int]  # new tokens, in order
    drafted: int
    accepted: int
    eos: bool = False  # generation ended with an end-of-sequence token (not in `tokens`)
    draft_s: float = 0.0  # the drafter's steps of this round
    draft_steps: int = 0  # drafter forwards (the first may feed two pending tokens)
    verify_s: float = 0.0  # the target's forward over the pending token and the drafts


def speculate(target: Side, drafter: Side, config: GenerationConfig,
              speculation: SpeculationConfig = SpeculationConfig(), *,
              eos_ids: Iterable[int] = (), generator: torch.Generator | None = None,
              accept: AcceptRule = accept_drafts,
              policy: SpeculationPolicy | None = None) -> Iterator[Round]:
    """Yield rounds until `config.max_new_tokens` or an end-of-sequence token.

    Between rounds both caches hold exactly the accepted sequence minus the pending tokens.
    speculation: γ, η, the residual, the adaptive draft length and the verification attention
    (`settings.SpeculationConfig`, validated there). With `min_draft_prob` a round stops
    drafting (before γ) once the drafter's probability of its own last draft falls below it:
    such a draft is likely rejected, and every draft after it is wasted drafter time.
    policy: decides each round's γ, 0 for a plain target step (rapid/policy.py); None: `gamma`
    every round.
    """
    gamma, eta, residual = speculation.gamma, speculation.eta, speculation.residual
    min_draft_prob = speculation.min_draft_prob
    eos = set(eos_ids)
    limit = config.max_new_tokens
    if generator is None:
        generator = torch.Generator()
        if config.seed is not None:
            generator.manual_seed(config.seed)
        else:
            generator.seed()
    if limit <= 0:
        return
    token = first_token(target.logits, drafter.logits, config, eta, generator)
    if token in eos:
        yield Round([], 0, 0, eos=True)
        return
    target.pending = [token]
    drafter.pending = [token]
    yield Round([token], 0, 0)
    produced = 1
    while produced < limit:
        room = limit - produced - 1
        g = policy.gamma_for(room) if policy is not None else min(gamma, room)
        drafts: list[int] = []
        draft_logits = []
        t0 = time.perf_counter()
        steps = 0
        if g > 0:
            logits = drafter.feed(drafter.pending, verify=True)[-1]
            steps += 1
            drafter.pending = []
            for j in range(g):
                draft_logits.append(logits)
                d = sample(logits, config, generator)
                drafts.append(d)
                if d in eos or j == g - 1:
                    break  # nothing after an end-of-sequence draft can be accepted
                if min_draft_prob > 0 and _draft_prob(logits, d, config) < min_draft_prob:
                    break  # the drafter doubts this one: verify now rather than draft on
                logits = drafter.feed([d])[-1]
                steps += 1
        t1 = time.perf_counter()
        fed = target.pending + drafts
        t_logits = target.feed(fed, keep=len(drafts) + 1, verify=speculation.verify_split)
        verdict = accept(drafts, t_logits,
                         torch.stack(draft_logits) if draft_logits else t_logits[:0],
                         config, eta=eta, residual=residual, generator=generator)
        n = verdict.accepted
        # Target: keep pending + accepted drafts; the new token stays pending.
        target.truncate(target.cache.length - (len(drafts) - n))
        target.pending = [verdict.token]
        # Drafter: it was fed its pending tokens and drafts[:-1].
        if drafts:
            fed_drafts = len(drafts) - 1
            kept = min(n, fed_drafts)
            drafter.truncate(drafter.cache.length - (fed_drafts - kept))
            drafter.pending = drafts[kept:n] + [verdict.token]
        else:
            drafter.pending = drafter.pending + [verdict.token]
        t2 = time.perf_counter()
        if policy is not None:
            policy.observe(len(drafts), n, t1 - t0, steps, t2 - t1)
        new = drafts[:n] + [verdict.token]
        out = []
        ended = False
        for t in new:
            if t in eos:
                ended = True
                break
            out.append(t)
        out = out[:limit - produced]
        produced += len(out)
        yield Round(out, len(drafts), n, eos=ended, draft_s=t1 - t0, draft_steps=steps,
                    verify_s=t2 - t1)
        if ended:
            return


def _draft_prob(logits: torch.Tensor, token: int, config: GenerationConfig) -> float:
    """The drafter's probability of `token` (at temperature 1 when greedy)."""
    z = logits.float() if config.greedy else logits.float() / config.temperature
    return float(torch.softmax(z, -1)[token])
