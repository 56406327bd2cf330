"""oneDNN-packed Linear products for batched steps: the numbers of F.linear (to rounding), a
row's result independent of the rows beside it, and a clear error for an unknown mode."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turborag_integrations.core.decode.fast import FastDecoder
from turborag_integrations.core.decode.packed import PackedLinears, _ops

pytestmark = pytest.mark.skipif(_ops() is None, reason="no oneDNN in this torch build")


def test_packed_products_equal_f_linear_on_every_layer(tiny):
    fast = FastDecoder.for_model(tiny.model)
    packed = PackedLinears.for_decoder(fast, rows=8, mode="packed")
    assert packed is not None
    gen = torch.Generator().manual_seed(1)
    modules = [fast.lm_head] + [m for L in fast.layers
                                for m in (L.q, L.k, L.v, L.o, L.gate, L.up, L.down)]
    assert any(m.bias is not None for m in modules) == (tiny.model.config.model_type == "qwen2")
    with torch.inference_mode():
        for m in modules:
            x = torch.randn(8, m.in_features, generator=gen)
            want = F.linear(x, m.weight, m.bias)
            got = packed.apply(x, m)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # a row gives the same bits whether it is alone or among eight
            for i in (0, 5):
                assert torch.equal(packed.apply(x[i:i + 1], m)[0], got[i])
            # a [B, 1, features] input keeps its shape, as F.linear does
            assert packed.apply(x[:, None], m).shape == (8, 1, m.out_features)


def test_packed_products_are_built_once_per_decoder(tiny_llama):
    fast = FastDecoder.for_model(tiny_llama.model)
    a = PackedLinears.for_decoder(fast, rows=8, mode="packed")
    assert PackedLinears.for_decoder(fast, rows=8, mode="packed") is a
    assert PackedLinears.for_decoder(fast, rows=8, mode="linear") is None


def test_an_unknown_batch_matmul_names_the_choices(tiny_llama, monkeypatch):
    fast = FastDecoder.for_model(tiny_llama.model)
    with pytest.raises(ValueError, match=r"TURBORAG_BATCH_MATMUL.*'auto', 'packed', 'linear'"):
        PackedLinears.for_decoder(fast, rows=8, mode="fastest")
    monkeypatch.setenv("TURBORAG_BATCH_MATMUL", "mkl")
    with pytest.raises(ValueError, match="'mkl'"):
        PackedLinears.for_decoder(fast, rows=8)


def test_quantised_decoders_get_no_packed_products(tiny_llama):
    fast = FastDecoder.for_model(tiny_llama.model, quantize="bf16")
    assert PackedLinears.for_decoder(fast, rows=8, mode="packed") is None
