"""The block-wise attention of a stitched prompt's plain tokens (what a recovery's recompute
runs) equals one masked attention over the whole cache, however its rows fall into blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turborag_integrations.core.attention import stitched_attention


def reference(query, key, value, seen, scale):
    """One SDPA call with the mask written out: row i sees cached entries < seen[i] and plain
    tokens 0..i."""
    n, total = query.shape[2], key.shape[2]
    cached = total - n
    cols = torch.arange(total)
    rows = torch.arange(n)
    allowed = torch.where(cols[None, :] < cached, cols[None, :] < seen[:, None],
                          cols[None, :] - cached <= rows[:, None])
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed[None, None],
                                          scale=scale, enable_gqa=True)


@pytest.mark.parametrize("pattern", ["spread", "crowded late", "none cached", "one row"])
def test_block_wise_equals_one_masked_attention(pattern):
    torch.manual_seed(0)
    cached, heads, kv_heads, d = 1500, 6, 2, 16
    if pattern == "spread":
        seen = torch.linspace(0, cached, 300).long()
    elif pattern == "crowded late":  # what a query-aware recovery picks: a few early, most late
        seen = torch.cat([torch.tensor([3, 40, 700]), torch.arange(1200, 1500)])
    elif pattern == "none cached":
        seen = torch.zeros(50, dtype=torch.long)
    else:
        seen = torch.tensor([cached])
    n = len(seen)
    query = torch.randn(1, heads, n, d)
    key, value = torch.randn(1, kv_heads, cached + n, d), torch.randn(1, kv_heads, cached + n, d)
    got = stitched_attention(query, key, value, seen, None)
    torch.testing.assert_close(got, reference(query, key, value, seen, d ** -0.5),
                               atol=1e-5, rtol=1e-4)
