"""One decode step for several requests at once, each with its own cache and position.

A decode step of a small model on a CPU reads the weights (≈540 MB fp32 for SmolLM2-135M) and
each request's cache (≈94 MB at 2K tokens). `BatchedDecoder.step` stacks the current token of B
requests into B rows and runs the embedding, every RMSNorm and every Linear layer (q/k/v/o,
gate/up/down, lm_head) once on all rows, so the weights are read once per step whatever B is.
What cannot be shared stays per request: RoPE turns each row at its own position, each row's
keys and values go to its own cache, and each row attends over its own cache only, through the
same attention function as the single-request path (caches of their own: one call per row, no
mask; rows of one arena: one call for all, below).

The layer loop is `FastDecoder.run_layers`: the same modules, functions and matmul formulation
(`FastDecoder.matmul`) as a single-request step; only the attention callback differs. With one
request `step` equals `FastDecoder.step` bit for bit. With several, a Linear layer multiplies B
rows in one call and the BLAS library picks its kernel by shape, so a row's logits can differ
from its single-request logits in the last bits (another summation order; ≤1e-5 relative in the
tests, and greedy tokens equal).

Two things make a step of B > 1 rows cheaper than B one-row steps beyond the shared weight read:
- caches that are the rows in use of one `BatchArena` (core/kv/arena.py; the scheduler
  keeps its batch there) are attended in one call per layer, each row masked to its own length,
  and their new keys and values are written in one indexed store per layer, instead of one
  update and one attention call per request and layer (caches of any other kind still get
  those);
- the Linear layers run on oneDNN-packed weights where that is faster (core/decode/packed.py).
A row's logits then differ from its one-row step in the last bits, as above.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..kv.arena import BatchArena
from .fast import FastDecoder
from .packed import PackedLinears


class BatchedDecoder:
    """Batched one-token decode steps over a model's `FastDecoder`; see the module docstring."""

    def __init__(self, fast: FastDecoder, packed: PackedLinears | None = None):
        self.fast = fast
        self.packed = packed

    @classmethod
    def for_model(cls, model, quantize: str | None = None, matmul: str | None = None,
                  rows: int = 8, batch_matmul: str | None = None) -> "BatchedDecoder | None":
        """A batched decoder over `FastDecoder.for_model(model, quantize, matmul)`; None where
        the fast path does not support the model (same rules, see core/decode/fast.py).

        rows and batch_matmul choose the Linear product of steps of several rows
        (`PackedLinears.for_decoder(fast, rows, batch_matmul)`: packed weights for up to `rows`
        rows where they are faster, else the one-row product)."""
        fast = FastDecoder.for_model(model, quantize, matmul)
        if fast is None:
            return None
        return cls(fast, PackedLinears.for_decoder(fast, rows, batch_matmul))

    def step(self, tokens: Sequence[int], positions: Sequence[int],
             caches: Sequence) -> torch.Tensor:
        """Logits [B, vocab] of the next token of each request after feeding `tokens[i]` at
        `positions[i]`; appends each request's keys/values to `caches[i]`."""
        if not len(tokens) == len(positions) == len(caches):
            raise ValueError(f"{len(tokens)} tokens, {len(positions)} positions and "
                             f"{len(caches)} caches: one of each per request")
        if not tokens:
            raise ValueError("a batched step needs at least one request")
        if len(caches) == 1:
            return self._run(tokens, positions, self._attend_one(caches[0]), None)
        arena = BatchArena.of(caches)
        if arena is None:
            return self._run(tokens, positions, self._attend_each(caches), self.packed)
        # the arena's rows in row order; the logits go back in the caller's order
        order = sorted(range(len(caches)), key=lambda i: arena.row_of(caches[i]))
        logits = self._run([tokens[i] for i in order], [positions[i] for i in order],
                           self._attend_arena(arena), self.packed)
        if order == list(range(len(order))):
            return logits
        back = [0] * len(order)
        for row, i in enumerate(order):
            back[i] = row
        return logits[back]

    __call__ = step

    def _run(self, tokens, positions, attend, packed: PackedLinears | None) -> torch.Tensor:
        fast = self.fast
        device = fast.embed.weight.device
        ids = torch.tensor([[t] for t in tokens], device=device)
        position_ids = torch.tensor([[p] for p in positions], device=device)
        apply = packed.apply if packed is not None else None
        hidden = fast.run_layers(ids, position_ids, attend, apply)
        return (apply or fast.apply)(hidden, fast.lm_head)[:, -1]

    def _attend_one(self, cache):
        attention = self.fast.attention

        def attend(L, q, k, v):  # exactly the single-request call
            k, v = cache.update(k, v, L.idx)
            return attention(L.attn, q, k, v, None, dropout=0.0, scaling=L.attn.scaling)[0]

        return attend

    def _attend_each(self, caches):
        attention = self.fast.attention

        def attend(L, q, k, v):
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

        return attend

    def _attend_arena(self, arena):
        """Attention for every row in use of `arena` (row i's query in row i): one indexed
        write of the new keys/values and one masked attention call per layer."""
        lengths = [c.length for c in arena.caches]  # where each row's new token goes
        span = max(lengths) + 1
        arena.reserve(span)
        device = arena.k.device
        at = torch.tensor(lengths, device=device)
        # row i attends to its first lengths[i] + 1 positions; the others weigh exactly 0
        mask = torch.zeros(len(lengths), 1, 1, span, dtype=arena.k.dtype, device=device)
        mask.masked_fill_(torch.arange(span, device=device) > at[:, None, None, None],
                          float("-inf"))
        attention = self.fast.attention

        def attend(L, q, k, v):
            keys, values = arena.append_token(L.idx, k, v, at, span)
            return attention(L.attn, q.contiguous(), keys, values, mask, dropout=0.0,
                             scaling=L.attn.scaling)[0]

        return attend
