"""Attention switches for our own forwards: split verification attention, masked GQA on CPU.

Both change how transformers' "sdpa" attention computes a forward, not what it computes (up to
float rounding), and both are switched on per forward call, in the calling thread only:

- `suffix_causal(model)`: verification attention, k new tokens over a long cache at the cost of
  about one decode step (below).
- `sdpa_gqa(device)`: a masked forward on CPU runs PyTorch's grouped-query attention
  (`enable_gqa=True`) instead of transformers' copy of every key/value head once per query head
  (repeat_kv). Stock transformers does that copy whenever a mask is given, because CUDA's fused
  kernels refuse masked GQA; PyTorch's CPU kernel handles it, and at 4K cached tokens it makes the
  stitched question prefill ~17% faster.

How the switch reaches the attention: transformers looks the attention function up by the
model's `config._attn_implementation` in every layer and passes it the forward's keyword
arguments, with no per-call choice of function. So `attention_forward` is registered, once, as
transformers' "sdpa" function, wrapping the stock one; it reads a `contextvars.ContextVar`
(each thread, and each asyncio task, has its own value) and, when no switch is on, calls the
stock function with the same arguments, so every other forward in the process (another thread,
another library) computes exactly what stock SDPA computes. Neither `os.environ` nor the model's config is ever written.

Verification attention. RAPID's target verifies γ + 1 tokens in one forward over the whole long
context. With stock SDPA a multi-token query over a cache gets a [k, cache + k] mask, and a masked
query makes transformers repeat_kv and PyTorch take a slower masked kernel: at 8K cached tokens an
11-token forward cost 5.4 one-token steps (MEASURED.md).

The mask carries no information here: the new tokens come after everything in the cache, so
each of them sees the whole old cache and, causally, the new tokens before it. Attention splits
exactly into two parts merged by their log-sum-exp:

- the old cache, no mask: the query heads of one key/value head are packed into the query
  dimension ([kv_heads, group·k, dim]), so there is no repeat_kv and no mask, the same kernel
  and memory traffic as a one-token decode step;
- the k new tokens, a k × k causal block (tiny).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class _Switches:
    split: bool = False  # suffix_causal: several new tokens after the whole cache
    gqa: bool = False  # sdpa_gqa: masked CPU calls through enable_gqa


_OFF = _Switches()
_switches: contextvars.ContextVar[_Switches] = contextvars.ContextVar(
    "turborag_attention", default=_OFF)
# Keyword arguments whose meaning the mask alone does not carry (a bias, a window, a cap, sinks):
# a call with any of them set goes to the stock function whatever the switches say.
_STOCK_ONLY = ("position_bias", "sliding_window", "softcap", "s_aux")
_lock = threading.Lock()
_stock = None  # the "sdpa" function that was registered before ours
_installed = False


def _install() -> None:
    """Register `attention_forward` as transformers' "sdpa" attention (once per process)."""
    global _stock, _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        _stock = ALL_ATTENTION_FUNCTIONS["sdpa"]
        AttentionInterface.register("sdpa", attention_forward)
        _installed = True


def _stock_sdpa():
    if _stock is not None:
        return _stock
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


@contextlib.contextmanager
def _switched(**changes):
    _install()
    token = _switches.set(replace(_switches.get(), **changes))
    try:
        yield
    finally:
        _switches.reset(token)


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
    """transformers' "sdpa" attention under this thread's switches; with none on, the stock
    function itself."""
    stock = _stock_sdpa()
    # dynamo cannot trace a context variable read: a compiled forward gets the stock function
    switches = _OFF if torch.compiler.is_compiling() else _switches.get()
    if switches == _OFF or any(kwargs.get(name) is not None for name in _STOCK_ONLY):
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)
    k = query.shape[2]
    if switches.split and k > 1 and query.shape[0] == 1 and not dropout and key.shape[2] >= k:
        out = split_attention(query, key, value, scaling)
        return out.transpose(1, 2).contiguous(), None
    if (switches.gqa and attention_mask is not None and query.device.type == "cpu"
            and getattr(module, "num_key_value_groups", 1) > 1):
        # What the stock function does for a masked call once it has chosen GQA: with a mask it
        # never asks for the causal kernel.
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                 is_causal=is_causal, **kwargs)


def suffix_causal(model, enabled: bool = True):
    """Forwards inside, in this thread, use split attention when several new tokens come after
    the whole cache (RAPID's verification).

    The causal mask of those calls is not read (it carries nothing more). Batch 1: one-token and
    batched calls run as without this switch. Only a model on transformers' "sdpa" attention is
    affected; for any other, and with enabled=False, this does nothing.
    """
    if not enabled or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return contextlib.nullcontext()
    return _switched(split=True)


def sdpa_gqa(device: torch.device):
    """Masked forwards inside, in this thread, use grouped-query SDPA without repeat_kv.

    Only on CPU (elsewhere this does nothing): PyTorch's CPU kernel takes masked GQA, and gives
    the same results as the repeated heads.
    """
    if device.type != "cpu":
        return contextlib.nullcontext()
    return _switched(gqa=True)
