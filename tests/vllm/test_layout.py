"""Reading a paged cache back (vllm/layout.py), without vLLM: the probe learns a layout from a
stand-in for the backend's cache write — vLLM's CPU one keeps keys transposed in a block, values
not — and refuses a write that does not place every element once."""

from __future__ import annotations

import pytest
import torch

from turborag_integrations.vllm.layout import UnreadableCacheLayout, probe_layout

BLOCKS, HEADS, BLOCK, DIM = 5, 3, 32, 64


def cpu_write(keys, values, cache, slots):
    """vLLM's CPU backend: a [blocks, heads, block_size, 2·dim] cache viewed as [blocks, heads,
    2·block_size, dim], keys as [dim, block_size] in the first half, values as [block_size,
    dim] in the second."""
    view = cache.view(cache.shape[0], HEADS, 2 * BLOCK, DIM)
    for t, slot in enumerate(slots.tolist()):
        block, at = divmod(slot, BLOCK)
        key_half = view[block, :, :BLOCK].reshape(HEADS, DIM, BLOCK)  # a view: written through
        key_half[:, :, at] = keys[t]
        view[block, :, BLOCK + at] = values[t]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_request_s_tokens_are_read_back_from_its_blocks(dtype):
    cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * DIM, dtype=dtype)
    layout = probe_layout(cpu_write, cache, HEADS, DIM, BLOCK)
    assert not cache.any()  # the probe wrote a scratch block, not the cache
    n, blocks = 80, [3, 0, 4]
    keys, values = (torch.randn(n, HEADS, DIM).to(dtype) for _ in range(2))
    slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)])
    cpu_write(keys, values, cache, slots)
    k, v = layout.read(cache, blocks, 10, n)
    assert torch.equal(k, keys[10:].transpose(0, 1)) and torch.equal(v, values[10:].transpose(0, 1))


def test_a_write_that_loses_elements_is_refused():
    def lossy(keys, values, cache, slots):
        cpu_write(keys, values * 0, cache, slots)  # values never land

    with pytest.raises(UnreadableCacheLayout, match="cannot be read back"):
        probe_layout(lossy, torch.zeros(2, HEADS, BLOCK, 2 * DIM), HEADS, DIM, BLOCK)


def test_a_write_that_rounds_is_refused():
    def rounding(keys, values, cache, slots):
        cpu_write((keys / 8).round() * 8, values, cache, slots)  # a coarse (quantized) cache

    with pytest.raises(UnreadableCacheLayout):
        probe_layout(rounding, torch.zeros(2, HEADS, BLOCK, 2 * DIM), HEADS, DIM, BLOCK)
