"""One decode step for several requests at once, each with its own cache and position.

A decode step of a small model on a CPU is bound by reading the weights (≈540 MB fp32 for
SmolLM2-135M), not by arithmetic. `BatchedDecoder.step` stacks the current token of B requests
into B rows and runs the embedding, every RMSNorm and every Linear layer (q/k/v/o, gate/up/down,
lm_head) once on all rows, so the weights are read once per step whatever B is. What cannot be
shared stays per request: RoPE turns each row at its own position, each row's keys and values go
to its own cache, and attention runs row by row over that row's cache, through the same attention
function as the single-request path. Caches of different lengths therefore need no padding and
no mask.

The layer loop is `FastDecoder.run_layers`: the same modules, functions and matmul formulation
(`FastDecoder.matmul`) as a single-request step; only the attention callback differs. With one
request `step` equals `FastDecoder.step` bit for bit. With several, a Linear layer multiplies B
rows in one call and the BLAS library picks its kernel by shape, so a row's logits can differ
from its single-request logits in the last bits (another summation order; ≤1e-5 relative in the
tests, and greedy tokens equal).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .fast import FastDecoder


class BatchedDecoder:
    """Batched one-token decode steps over a model's `FastDecoder`; see the module docstring."""

    def __init__(self, fast: FastDecoder):
        self.fast = fast

    @classmethod
    def for_model(cls, model, quantize: str | None = None,
                  matmul: str | None = None) -> "BatchedDecoder | None":
        """A batched decoder over `FastDecoder.for_model(model, quantize, matmul)`; None where
        the fast path does not support the model (same rules, see core/decode/fast.py)."""
        fast = FastDecoder.for_model(model, quantize, matmul)
        return None if fast is None else cls(fast)

    def step(self, tokens: Sequence[int], positions: Sequence[int],
             caches: Sequence) -> torch.Tensor:
        """Logits [B, vocab] of the next token of each request after feeding `tokens[i]` at
        `positions[i]`; appends each request's keys/values to `caches[i]`."""
        if not len(tokens) == len(positions) == len(caches):
            raise ValueError(f"{len(tokens)} tokens, {len(positions)} positions and "
                             f"{len(caches)} caches: one of each per request")
        if not tokens:
            raise ValueError("a batched step needs at least one request")
        fast = self.fast
        device = fast.embed.weight.device
        ids = torch.tensor([[t] for t in tokens], device=device)
        position_ids = torch.tensor([[p] for p in positions], device=device)
        attention = fast.attention

        def attend(L, q, k, v):
            if len(caches) == 1:  # exactly the single-request call
                k, v = caches[0].update(k, v, L.idx)
                return attention(L.attn, q, k, v, None, dropout=0.0, scaling=L.attn.scaling)[0]
            # `gemm` leaves B rows in column-major order; SDPA's fused CPU kernel needs a
            # unit stride in the last dimension and would fall back to its slow reference path
            q = q.contiguous()
            rows = []
            for i, cache in enumerate(caches):
                k_i, v_i = cache.update(k[i:i + 1], v[i:i + 1], L.idx)
                a, _ = attention(L.attn, q[i:i + 1], k_i, v_i, None, dropout=0.0,
                                 scaling=L.attn.scaling)
                rows.append(a)
            return torch.cat(rows)

        hidden = fast.run_layers(ids, position_ids, attend)
        return fast._apply(hidden, fast.lm_head)[:, -1]

    __call__ = step
