"""Sampling and speculative acceptance: the math under every decode loop.

Plain functions over logits and probabilities; nothing here runs a model or touches a cache, and
nothing above torch and the settings is imported, so the decode loop, self-speculation and RAPID
all build on the same few lines.

Acceptance (RAPID's retrieval-augmented target distribution, arXiv 2502.20330, η of its Eq. 6, as
the authors' reference code builds it: `_speculative_sampling` in src/utils.py of
github.com/John-AI-Lab/RAPID). With z = the target's warped logits, p = softmax(z) and q the
drafter's distribution at one position, the drafter's top set is S = {k : q_k ≥ α·max q}
(α = TAIL_RATIO = 0.1) and

    p̂ = softmax(z + η·(q − p)·1[k ∈ S])

(the logits of S move by η(q − p); every other logit stays the target's; no substitution after
the softmax). A drafted x is accepted with probability min(1, p̂(x)/q(x)); at the first rejection
the token is drawn from norm(max(p − p̂, p − q, 0)) ("rapid" residual); if all γ are accepted a
bonus token comes from p. With η = 0, p̂ = p and the residual is norm(max(p − q, 0)): standard
speculative sampling, which is lossless (the output follows p exactly). `residual="standard"`
draws from norm(max(p̂ − q, 0)) instead, which makes the output follow p̂ exactly for any η.
Greedy (T = 0) accepts while the drafted token is the target's argmax (of p̂ at T = 1 when η > 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..settings import GenerationConfig

# α of the drafter's top set {k : q_k ≥ α·max q}: only those logits move by η(q − p); the
# drafter's tail (below α·max q) keeps the target's logits. 0.1 is the reference code's `alpha`.
TAIL_RATIO = 0.1


def warp_logits(logits: torch.Tensor, config: GenerationConfig) -> torch.Tensor:
    """Logits after temperature, top-k and top-p, in the order transformers applies them."""
    logits = logits.float() / config.temperature
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if config.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop tokens once the mass before them already reaches top_p (always keep the first)
        drop = cumulative - sorted_logits.softmax(-1) >= config.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, config: GenerationConfig,
           generator: torch.Generator | None = None) -> int:
    """One token from next-token logits: the argmax when greedy, else a draw from the warped
    distribution."""
    if config.greedy:
        return int(logits.argmax(-1))
    probs = warp_logits(logits, config).softmax(-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """`sample` with the generator of one generation (seeded when the config has a seed)."""

    def __init__(self, config: GenerationConfig):
        self.config = config
        self.generator = torch.Generator()
        if config.seed is not None:
            self.generator.manual_seed(config.seed)
        else:
            self.generator.seed()

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_logits(logits, self.config).softmax(-1)

    def __call__(self, logits: torch.Tensor) -> int:
        return sample(logits, self.config, self.generator)


# ---- speculative acceptance ------------------------------------------------------------------

def augmented_probs(target_logits: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                    eta: float) -> torch.Tensor:
    """p̂ = softmax(z + η(q − p) on the drafter's top set); `target_logits` are z (already warped,
    so p = softmax(z)).

    Works on [..., vocab]. With η = 0 it returns p itself (exactly, not up to rounding).
    """
    if eta == 0:
        return p
    top = q >= TAIL_RATIO * q.amax(-1, keepdim=True)
    shift = torch.where(top, eta * (q - p), torch.zeros_like(p))
    return torch.softmax(target_logits + shift, dim=-1)


def residual_probs(p: torch.Tensor, p_hat: torch.Tensor, q: torch.Tensor,
                   residual: str = "rapid") -> torch.Tensor:
    """The distribution to draw from at a rejection (normalised; falls back to p̂ if empty)."""
    if residual == "rapid":
        r = torch.maximum(p - p_hat, p - q).clamp_(min=0)
    else:
        r = (p_hat - q).clamp_(min=0)
    total = r.sum(-1, keepdim=True)
    if float(total) <= 0:  # only by rounding: a rejection implies some mass
        return p_hat
    return r / total


@dataclass
class Verdict:
    accepted: int  # drafted tokens accepted
    token: int  # the token after them: the correction at a rejection, else the bonus


AcceptRule = Callable[..., Verdict]


def accept_drafts(drafts: Sequence[int], target_logits: torch.Tensor, draft_logits: torch.Tensor,
                  config: GenerationConfig, *, eta: float = 0.0, residual: str = "rapid",
                  generator: torch.Generator | None = None) -> Verdict:
    """Verify one round.

    target_logits: [γ + 1, vocab] raw logits of the target at the positions of the drafts and
    one past them; draft_logits: [γ, vocab] raw drafter logits the drafts were drawn from.
    """
    g = len(drafts)
    z = target_logits.float()
    zq = draft_logits.float()
    if config.greedy:
        if eta == 0:
            choice = z[:g + 1].argmax(-1)
        else:
            p, q = z[:g].softmax(-1), zq[:g].softmax(-1)
            choice = torch.cat([augmented_probs(z[:g], p, q, eta).argmax(-1), z[g:].argmax(-1)])
        for i, d in enumerate(drafts):
            if int(choice[i]) != d:
                return Verdict(i, int(choice[i]))
        return Verdict(g, int(choice[g]))
    warped = warp_logits(z, config)
    p_all = warped.softmax(-1)
    if g:
        q = warp_logits(zq, config).softmax(-1)
        p = p_all[:g]
        p_hat = augmented_probs(warped[:g], p, q, eta)
        idx = torch.as_tensor(list(drafts))
        rows = torch.arange(g)
        ratio = p_hat[rows, idx] / q[rows, idx]
        u = torch.rand(g, generator=generator)
        for i in range(g):
            if not bool(u[i] < ratio[i]):  # accept with probability min(1, p̂/q)
                r = residual_probs(p[i], p_hat[i], q[i], residual)
                return Verdict(i, int(torch.multinomial(r, 1, generator=generator)))
    return Verdict(g, int(torch.multinomial(p_all[g], 1, generator=generator)))


def first_token(target_logits: torch.Tensor, draft_logits: torch.Tensor | None,
                config: GenerationConfig, eta: float, generator: torch.Generator) -> int:
    """The first new token, from the two prefills: drawn from p̂ (p when η = 0)."""
    z = target_logits.float()
    if eta == 0 or draft_logits is None:
        return sample(z, config, generator)
    if config.greedy:
        p, q = z.softmax(-1), draft_logits.float().softmax(-1)
        return int(augmented_probs(z, p, q, eta).argmax(-1))
    warped = warp_logits(z, config)
    p = warped.softmax(-1)
    q = warp_logits(draft_logits.float(), config).softmax(-1)
    return int(torch.multinomial(augmented_probs(warped, p, q, eta), 1, generator=generator))
