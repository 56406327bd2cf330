"""How far a stored tensor may decode from the original: the bounds of core/store/codec.py's math.

Floats (`to(dtype)`, round to nearest): |x̂ − x| ≤ u·|x|, u the unit roundoff: 2^-8 for
bfloat16 (8 significant bits), 2^-11 for float16 (11), plus float16's half gap below its normal
range (2^-25) for tiny values.

int8 (`_quantize`, per group of min m and max M: key groups are 64 tokens of one channel of one
head, value groups one token's channels of one head). The stored minimum is lo = fp16(m) and the
step fp16((M − lo)/255); a value's code is round((x − lo)/step) clamped to 0..255 and decodes to
code·step + lo. So:

- unclamped: |x̂ − x| ≤ step/2, with step ≤ (1 + u16)·(M − lo)/255;
- clamped at 0 (x − lo < −step/2, only when fp16 rounded m up): |x̂ − x| ≤ lo − m ≤ u16·|m|;
- clamped at 255 (fp16 rounded the step down): |x̂ − x| ≤ 255·(exact step − step) ≤ u16·(M − lo);

and M − lo ≤ M − m + u16·|m|. The bound below adds the three, plus float32 rounding in the
arithmetic (a few 2^-24·|x|) and fp16's half gap for a step that falls below its normal range.
About (M − m)/510: for values spread over ±A, 0.004·A, where the earlier test allowed 0.1·A.
"""

from __future__ import annotations

import torch

U16 = 2.0 ** -11
HALF_GAP16 = 2.0 ** -25  # half the spacing of float16 subnormals
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": U16}
KEY_GROUP = 64  # tokens per key group, as codec.KEY_GROUP (checked by the test that uses it)


def _int8_group_bound(x: torch.Tensor, dim: int) -> torch.Tensor:
    m = x.amin(dim=dim, keepdim=True).double()
    big = x.abs().amax(dim=dim, keepdim=True).double()
    span = x.amax(dim=dim, keepdim=True).double() - m + U16 * m.abs()  # ≥ M − lo
    bound = (span * (1 + U16) / 510 + U16 * (m.abs() + span)
             + 4 * 2.0 ** -24 * big + 257 * HALF_GAP16)
    return bound.expand_as(x)


def int8_bound(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-element bound of int8 storage for a [layers, heads, tokens, dim] tensor."""
    x = tensor.double()
    if kind == "values":
        return _int8_group_bound(x, dim=3)
    slabs = [_int8_group_bound(s, dim=2) for s in x.split(KEY_GROUP, dim=2)]
    return torch.cat(slabs, dim=2)


def assert_within_storage_bound(got: torch.Tensor, original: torch.Tensor, storage_dtype: str,
                                kind: str) -> None:
    """`got` decoded from `original` stored as `storage_dtype` ("keys" or "values": the int8
    grouping differs) is within the codec's error bound, element by element."""
    assert got.shape == original.shape and got.dtype == original.dtype
    err = (got.double() - original.double()).abs()
    if storage_dtype == "int8":
        bound = int8_bound(original, kind)
    else:
        u = UNIT_ROUNDOFF[storage_dtype]
        bound = u * original.double().abs() + (HALF_GAP16 if storage_dtype == "float16" else 0.0)
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{storage_dtype} {kind}: error {float(err.flatten()[worst]):.3g} > bound "
        f"{float(bound.flatten()[worst]):.3g} at flat index {worst}")
