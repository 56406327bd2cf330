"""Verification attention: k new tokens over a long cache at the cost of about one decode step.

RAPID's target verifies γ + 1 tokens in one forward over the whole long context. With the stock
SDPA path a multi-token query over a cache gets a [k, cache + k] mask, and a masked query makes
transformers copy every key/value head once per query head (repeat_kv) and PyTorch take a slower
masked kernel: at 8K cached tokens an 11-token forward cost 5.4 one-token steps (MEASURED.md).

The mask carries no information here: the new tokens come after everything in the cache, so
each of them sees the whole old cache and, causally, the new tokens before it. Attention splits
exactly into two parts merged by their log-sum-exp:

- the old cache, no mask: the query heads of one key/value head are packed into the query
  dimension ([kv_heads, group·k, dim]), so there is no repeat_kv and no mask, the same kernel
  and memory traffic as a one-token decode step;
- the k new tokens, a k × k causal block (tiny).

`suffix_causal(model)` turns this on for the forwards inside it, in this thread only; any other
forward of the same model (another thread, a stitched prefill) goes through stock SDPA unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading

import torch

NAME = "turborag_suffix_causal"
_active: contextvars.ContextVar[bool] = contextvars.ContextVar("turborag_suffix_causal", default=False)
_lock = threading.Lock()
_users: dict[int, int] = {}  # id(config) → number of open suffix_causal blocks
_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, attention_forward)
    # The stock SDPA mask: a forward outside suffix_causal (another thread) stays exact.
    AttentionMaskInterface.register(NAME, sdpa_mask)
    _registered = True


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float | None) -> torch.Tensor:
    """Attention of `query` [b, heads, k, d] over `key`/`value` [b, kv_heads, n, d] where the last
    k keys belong to the query tokens (causal among them) and all earlier keys are visible.

    Returns [b, heads, k, d].
    """
    b, heads, k, d = query.shape
    kv_heads, n = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = d ** -0.5 if scaling is None else scaling
    # [b, kv_heads, group·k, d]: head-major rows, the heads of one kv head side by side
    qp = query.reshape(b, kv_heads, group * k, d)
    kb, vb = key[:, :, n - k:], value[:, :, n - k:]
    scores = torch.matmul(qp, kb.transpose(-1, -2)) * scale  # [b, kv, group·k, k]
    causal = torch.ones(k, k, dtype=torch.bool, device=query.device).tril_().repeat(group, 1)
    scores = scores.masked_fill(~causal, float("-inf"))
    lse_block = torch.logsumexp(scores, -1)
    out_block = torch.matmul(torch.softmax(scores, -1), vb)
    if n > k:
        if query.device.type == "cpu":
            out_old, lse_old = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qp, key[:, :, : n - k], value[:, :, : n - k], 0.0, False, scale=scale)[:2]
        else:  # plain math; CUDA has fast masked GQA kernels anyway
            s = torch.matmul(qp, key[:, :, : n - k].transpose(-1, -2)) * scale
            lse_old = torch.logsumexp(s, -1)
            out_old = torch.matmul(torch.softmax(s, -1), value[:, :, : n - k])
        lse = torch.logaddexp(lse_old, lse_block)
        out = (out_old * torch.exp(lse_old - lse).unsqueeze(-1).to(out_old.dtype)
               + out_block * torch.exp(lse_block - lse).unsqueeze(-1).to(out_block.dtype))
    else:
        out = out_block
    return out.reshape(b, heads, k, d).to(query.dtype)


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k = query.shape[2]
    if (not _active.get() or k == 1 or query.shape[0] != 1 or dropout
            or key.shape[2] < k or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out = split_attention(query, key, value, scaling)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def suffix_causal(model, enabled: bool = True):
    """Forwards inside use split attention when every new token comes after the whole cache.

    Only for models on stock SDPA (others are left alone). Batch 1.
    """
    config = model.config
    if not enabled or getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        yield
        return
    with _lock:
        _register()
        if _users.get(id(config), 0) == 0:
            config._attn_implementation = NAME
        _users[id(config)] = _users.get(id(config), 0) + 1
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)
        with _lock:
            _users[id(config)] -= 1
            if _users[id(config)] == 0:
                del _users[id(config)]
                config._attn_implementation = "sdpa"
