"""How much the question needs each cached chunk token: its attention to them over the stitch.

Query-aware recompute (core/prefill/recovery.py, `select:`) spends its budget on the chunk tokens
the question reads, not on those that are salient to the chunks themselves (ProphetKV, arXiv
2602.02579: the "crowding-out" of question-relevant tokens by globally salient ones). The
signal is one stitched prefill of the prompt's plain tokens — the prefill TurboRAG runs anyway —
during which every layer's attention of the *tail* (the plain tokens after the last cached span:
the question and the template's end) to every cache entry is read off:

    score(t) = mean over layers ℓ, query heads h and tail tokens q of softmax(q·Kᵀ/√d)[t]

Each layer's probabilities sum to 1 over what the token sees, so layers weigh alike. The probe
computes only the tail's rows (tail × cache per layer, a few per cent of the forward); the forward
itself runs as usual and its cache is thrown away, since every token after a recomputed one must
be prefilled again over the corrected cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import attention_probe
from .stitch import StitchPlan, assemble, run_plain


def tail_length(plan: StitchPlan) -> int:
    """The plain tokens after the last cached span (at least the last prompt token)."""
    end = max((s.prompt_start + s.blob.num_tokens for s in plan.spans), default=0)
    return max(1, sum(1 for i in plan.plain_index if i >= end))


class _Enough(Exception):
    """Raised by the probe past the last layer it reads: the rest of the forward is not needed."""


class TailAttention:
    """Collects, layer by layer, the mean attention of the last `tail` query rows to each key,
    over the layers in `layers` (a range of layer indices; all when None)."""

    def __init__(self, tail: int, layers: range | None = None):
        self.tail = tail
        self.read = layers
        self.total: torch.Tensor | None = None
        self.layers = 0

    def observe(self, module, query, key, mask, scaling) -> None:
        index = getattr(module, "layer_idx", None)
        if self.read is not None and index is not None and index not in self.read:
            if index >= self.read.stop:
                raise _Enough
            return
        b, heads, rows, d = query.shape
        t = min(self.tail, rows)
        kv_heads, n = key.shape[1], key.shape[2]
        group = heads // kv_heads
        scale = d ** -0.5 if scaling is None else scaling
        # the query heads that share a kv head side by side: no copy of the keys per head
        q = query[:, :, rows - t:].reshape(b, kv_heads, group * t, d)
        scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [b, kv, group·t, n]
        if mask is None:  # the stock causal mask: query row r sees keys ≤ n − rows + r
            seen = (torch.arange(n, device=key.device)[None, :]
                    <= torch.arange(n - t, n, device=key.device)[:, None])
        else:
            rows_mask = mask[0, 0, rows - t:, :n]
            seen = rows_mask if rows_mask.dtype == torch.bool else rows_mask == 0
        seen = seen.repeat(group, 1)  # rows are group-major: head g's t rows, then g+1's
        scores = scores.masked_fill(~seen, float("-inf"))
        probs = torch.softmax(scores, dim=-1).mean(dim=(0, 1, 2))  # [n]
        self.total = probs if self.total is None else self.total + probs
        self.layers += 1
        if self.read is not None and index is not None and index == self.read.stop - 1:
            raise _Enough  # the last layer read: its MLP, the norm and the logits are not needed


@dataclass
class Relevance:
    """Per prompt index, the question's attention to it (0 for tokens that are prefilled)."""

    scores: torch.Tensor  # [prompt] float32, on the CPU
    tail: int  # the query tokens it was read from
    seconds: float = 0.0


def question_attention(model, plan: StitchPlan, rotator, pool=None,
                       layers: range | None = None) -> Relevance:
    """Stitch `plan`, prefill its plain tokens once under the probe, and map each cache entry's
    score back to its prompt index. `layers`: the layers whose attention is read (all when
    None); the forward stops after the last of them."""
    import time

    t0 = time.perf_counter()
    tail = tail_length(plan)
    cache = assemble(model, plan, rotator, len(plan.token_ids) + 1, pool)
    if layers is None:
        layers = range(model.config.num_hidden_layers)
    probe = TailAttention(tail, layers)
    try:
        with attention_probe(probe):
            run_plain(model, plan, cache)
    except _Enough:
        pass
    finally:
        if pool is not None:
            pool.release(cache)
    if probe.total is None:
        raise ValueError(
            "query-aware recompute reads the question's attention from transformers' \"sdpa\" "
            f"attention, and {type(model).__name__} runs "
            f"{getattr(model.config, '_attn_implementation', 'another')!r}: load it with "
            "attn_implementation=\"sdpa\", or use another recovery (boundary:K, blend:R)")
    in_cache = [i for s in plan.spans for i in range(s.prompt_start, s.prompt_start
                                                      + s.blob.num_tokens)] + list(plan.plain_index)
    scores = torch.zeros(len(plan.token_ids))
    scores[torch.tensor(in_cache)] = (probe.total / probe.layers).cpu()
    return Relevance(scores, tail, time.perf_counter() - t0)
