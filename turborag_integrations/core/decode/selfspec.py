"""Self-speculative decoding: a quantised copy of the model drafts, the model itself verifies.

On a CPU a decode step is bound by reading the weights, so an int8 copy (a quarter of the bytes)
steps about twice as fast, but its greedy answers drift from full precision on small models (see
core/decode/fast.py). Used as a *drafter* instead, it proposes `draft_tokens` tokens one by one and the
full-precision model checks them all in one forward, which costs little more than one step
because the weights are read once for every token in it. The accepted tokens are the model's own:
greedy output is the full-precision greedy output (up to the rounding of a multi-token forward
against one-token steps), and sampling follows the model's distribution exactly (speculative
sampling, the acceptance rule of core/decode/sampling.py with η = 0).

Both share one KV cache. Drafting appends the drafter's approximate keys/values after the
accepted prefix; before verification they are cut off again, and the verifying forward writes
exact ones for the tokens it keeps. So the cache only ever holds full-precision entries between
rounds (invariant 5), and the drafter always reads the model's exact context, which keeps its
acceptance high.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from .fast import FastDecoder
from .sampling import accept_drafts, sample
from .start import DecodeStart


@dataclass
class DraftStats:
    """Counts of one speculative decode (readable while it runs); RAPID's stats share them."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per verification round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def as_dict(self) -> dict:
        return {"draft_rounds": self.rounds, "drafted_tokens": self.drafted,
                "accepted_drafts": self.accepted, "draft_acceptance": self.acceptance_rate}


def drafter_for(model, mode: str) -> FastDecoder | None:
    """The quantised fast decoder that drafts for `model`, or None where it cannot run."""
    try:
        return FastDecoder.for_model(model, mode)
    except (ValueError, RuntimeError):
        return None


def speculative_decode(model, drafter: FastDecoder, start: DecodeStart, config,
                       eos_ids: set[int], limit: int, sampler,
                       stats: DraftStats | None = None) -> Iterator[int]:
    """Yield up to `limit` new token ids, `config.draft_tokens` drafts per round.

    start: the prompt's cache, which grows by every accepted token (the last one yielded is
    never fed, as in `decode_loop`), the model's next-token logits after it, and the next
    position.
    """
    cache, logits, position = start
    stats = stats if stats is not None else DraftStats()
    verifier = FastDecoder.for_model(model)  # full precision, several tokens per forward
    token = sampler(logits)
    if token in eos_ids or limit <= 0:
        return
    yield token
    produced = 1
    while produced < limit:
        g = min(config.draft_tokens, limit - produced - 1)
        base = cache.length
        drafts, draft_logits = [], []
        x = token
        with torch.inference_mode():
            for j in range(g):
                step_logits = drafter.step(x, position + j, cache)
                d = sample(step_logits, config, sampler.generator)
                drafts.append(d)
                draft_logits.append(step_logits)
                if d in eos_ids:
                    break  # nothing after an end-of-sequence draft can be accepted
                x = d
            cache.truncate(base)  # the drafter's approximate entries go; exact ones come next
            fed = [token] + drafts
            t_logits = verifier.forward(fed, position, cache)
        verdict = accept_drafts(drafts, t_logits,
                                torch.stack(draft_logits) if draft_logits else t_logits[:0],
                                config, generator=sampler.generator)
        n = verdict.accepted
        cache.truncate(base + 1 + n)  # keep `token` and the accepted drafts
        position += 1 + n
        stats.rounds += 1
        stats.drafted += len(drafts)
        stats.accepted += n
        for t in drafts[:n] + [verdict.token]:
            if t in eos_ids:
                return
            yield t
            produced += 1
            if produced >= limit:
                return
        token = verdict.token
