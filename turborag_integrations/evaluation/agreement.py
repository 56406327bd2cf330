"""Token-level agreement of a mode with the full prefill over one reply.

The full prefill's (naive) reply is teacher-forced through both paths: the naive one and the
mode's (stitched, possibly with a recovery). At every reply position both give a next-token
distribution; `token_agreement` compares them — mean KL(naive ‖ mode) in nats and the share of
positions whose most likely token is the same.

Position j of a reply of n tokens is the distribution that predicts reply token j: position 0
is the prefill's last logits, positions 1..n−1 come from one forward of reply tokens 0..n−2 over
the prefilled cache.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from ..core.request import Request
from ..core.transformers_api import with_cache


def token_agreement(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """(mean KL(reference ‖ other) in nats, top-1 agreement in %) over the rows of two
    [positions, vocab] logit tensors; rows past the shorter of the two are ignored."""
    n = min(len(reference), len(other))
    if n == 0:
        raise ValueError("no positions to compare")
    log_p = torch.log_softmax(reference[:n].to(torch.float64), dim=-1)
    log_q = torch.log_softmax(other[:n].to(torch.float64), dim=-1)
    p = log_p.exp()
    # where p is 0 its term is 0 (also where log p or log q is -inf)
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    kl = terms.sum(dim=-1).clamp_min(0.0)  # ≥ 0 in exact arithmetic; drop rounding below it
    top1 = (log_p.argmax(dim=-1) == log_q.argmax(dim=-1)).to(torch.float64)
    return float(kl.mean()), 100.0 * float(top1.mean())


def reply_logits(engine, prompt, reply_ids: Sequence[int], *, chunks: Iterable[str] = (),
                 mode: str = "naive", recovery=None) -> torch.Tensor:
    """The next-token logits ([positions, vocab], float32, on the CPU) at each reply position,
    the reply teacher-forced after `prompt` (a text, or ready segments) prefilled as `mode`
    would prefill it.

    Fewer rows than reply tokens only where the window has no room for the whole reply after
    this mode's prompt."""
    reply_ids = [int(t) for t in reply_ids]
    n = len(reply_ids)
    if n == 0:
        raise ValueError("empty reply")
    if isinstance(prompt, str):
        segments, _, _ = engine.assembly.segments(prompt, chunks if mode == "turbo" else ())
    else:  # ready segments
        segments = list(prompt)
    if mode == "turbo" and isinstance(recovery, str):
        recovery = Request("", recovery=recovery).recovery  # parsed where requests parse it
    pre = engine.prefill(segments, reserve=n + 1,
                         recovery=recovery if mode == "turbo" else None)
    try:
        rows = [pre.logits.float().reshape(1, -1).cpu()]
        # the cache holds `reserve` more tokens, but none past the window
        m = min(n, engine.context_window - pre.next_position + 1)
        if m > 1:
            device = pre.logits.device
            ids = torch.tensor(reply_ids[:m - 1], device=device)
            p = pre.next_position
            with torch.inference_mode():
                out = engine.model(input_ids=ids[None],
                                   position_ids=torch.arange(p, p + m - 1, device=device)[None],
                                   **with_cache(pre.cache), use_cache=True)
            rows.append(out.logits[0].float().cpu())
        return torch.cat(rows)
    finally:
        engine.cache_pool.release(pre.cache)
