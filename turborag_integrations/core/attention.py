"""Attention switches for our own forwards: split verification attention, masked GQA on CPU,
and a probe that reads where the last query tokens attend.

None changes what transformers' "sdpa" attention computes (up to float rounding), and each is
switched on per forward call, in the calling thread only:

- `suffix_causal(model)`: verification attention, k new tokens over a long cache at the cost of
  about one decode step (below).
- `sdpa_gqa(device)`: a masked forward on CPU runs PyTorch's grouped-query attention
  (`enable_gqa=True`) instead of transformers' copy of every key/value head once per query head
  (repeat_kv). Stock transformers does that copy whenever a mask is given, because CUDA's fused
  kernels refuse masked GQA; PyTorch's CPU kernel handles it, and at 4K cached tokens it makes the
  stitched question prefill ~17% faster.
- `stitched_causal(seen)`: the plain tokens of a stitched prompt over its cache (core/prefill/
  stitch.py), attention computed block by block over only the keys each block can see (below).
- `attention_probe(probe)`: every attention call also hands its queries, keys and mask to
  `probe.observe` (query-aware recompute reads the question's attention to the chunks from it:
  core/prefill/relevance.py), then computes as it would have.

How the switch reaches the attention: transformers looks the attention function up by the
model's `config._attn_implementation` in every layer and passes it the forward's keyword
arguments, with no per-call choice of function. So `attention_forward` is registered, once, as
transformers' "sdpa" function, wrapping the stock one; it reads a `contextvars.ContextVar`
(each thread, and each asyncio task, has its own value) and, when no switch is on, calls the
stock function with the same arguments, so every other forward in the process (another thread,
another library) computes exactly what stock SDPA computes. Neither `os.environ` nor the model's config is ever written.

Stitched attention. A stitched prompt's cache holds its chunks' tokens first, in prompt order,
then the plain tokens of the forward (the question, glue, recomputed chunk tokens), also in
prompt order. Plain token i sees the first `seen[i]` cached entries (those before it in the
prompt) and plain tokens 0..i: two prefixes. The 4D mask says the same, but a masked kernel
computes every query against every key. Split into blocks of rows, a block needs only the cached
prefix its last row sees and the plain tokens up to its last row; the two parts are merged by
their log-sum-exp, exactly. Recomputed chunk tokens lie all over the prompt, so this halves the
attention of a recompute forward (on the CPU, where its fused kernel returns the log-sum-exp).

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
    probe: object = None  # attention_probe: sees every call's queries, keys and mask
    stitched: object = None  # stitched_causal: each query row's visible cached prefix length


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


STITCHED_BLOCK = 128  # query rows per block: fewer wasted keys vs more kernel calls


def stitched_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       seen: torch.Tensor, scaling: float | None,
                       block: int = STITCHED_BLOCK) -> torch.Tensor:
    """Attention of the n plain rows of `query` [1, heads, n, d] over `key`/`value`
    [1, kv_heads, c + n, d]: c cached entries, then the n plain tokens; row i sees the cached
    entries before `seen[i]` (non-decreasing) and plain tokens 0..i. Returns [1, heads, n, d].
    CPU only (its flash kernel's log-sum-exp)."""
    b, heads, n, d = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    cached = key.shape[2] - n
    scale = d ** -0.5 if scaling is None else scaling
    low = torch.finfo(query.dtype).min
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out = torch.empty_like(query)
    cols = torch.arange(cached + n)
    for r0 in range(0, n, block):
        r1 = min(n, r0 + block)
        k = r1 - r0
        # [1, kv_heads, group·k, d]: the query heads of one kv head side by side
        q = query[:, :, r0:r1].reshape(b, kv_heads, group * k, d)
        rows = seen[r0:r1]
        parts = []
        c = int(rows[-1])
        if c:
            mask = torch.zeros(k, c, dtype=query.dtype).masked_fill_(
                cols[None, :c] >= rows[:, None], low).repeat(group, 1)
            parts.append(flash(q, key[:, :, :c], value[:, :, :c], 0.0, False,
                               attn_mask=mask[None, None], scale=scale)[:2])
        mine = torch.arange(r0, r1)
        mask = torch.zeros(k, r1, dtype=query.dtype).masked_fill_(
            cols[None, :r1] > mine[:, None], low).repeat(group, 1)
        parts.append(flash(q, key[:, :, cached:cached + r1], value[:, :, cached:cached + r1],
                           0.0, False, attn_mask=mask[None, None], scale=scale)[:2])
        if len(parts) == 1:
            merged = parts[0][0]
        else:
            (o1, l1), (o2, l2) = parts
            lse = torch.logaddexp(l1, l2)
            merged = (o1 * torch.exp(l1 - lse).unsqueeze(-1).to(o1.dtype)
                      + o2 * torch.exp(l2 - lse).unsqueeze(-1).to(o2.dtype))
        out[:, :, r0:r1] = merged.reshape(b, heads, k, d)
    return out


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' "sdpa" attention under this thread's switches; with none on, the stock
    function itself."""
    stock = _stock_sdpa()
    # dynamo cannot trace a context variable read: a compiled forward gets the stock function
    switches = _OFF if torch.compiler.is_compiling() else _switches.get()
    if switches.probe is not None:
        switches.probe.observe(module, query, key, attention_mask, scaling)
    if switches == _OFF or any(kwargs.get(name) is not None for name in _STOCK_ONLY):
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                     is_causal=is_causal, **kwargs)
    k = query.shape[2]
    seen = switches.stitched
    if (seen is not None and query.device.type == "cpu" and query.shape[0] == 1
            and not dropout and k == len(seen) and key.shape[2] >= k):
        out = stitched_attention(query, key, value, seen, scaling)
        return out.transpose(1, 2).contiguous(), None
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


def stitched_causal(seen: torch.Tensor, device: torch.device):
    """Forwards inside, in this thread, whose queries are a stitched prompt's plain tokens (as
    many as `seen` has rows) attend block by block (`stitched_attention`): row i sees the first
    `seen[i]` cached entries and the plain tokens up to itself. CPU only; elsewhere nothing."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return _switched(stitched=seen)


def attention_probe(probe):
    """Attention calls inside, in this thread, first pass (module, query, key, mask, scaling) to
    `probe.observe`; what they compute is unchanged. The keys are the cache's whole content at
    that layer (past and new), unrepeated ([batch, kv_heads, n, dim]); the mask is what the
    layer gets (None, boolean or additive)."""
    return _switched(probe=probe)
