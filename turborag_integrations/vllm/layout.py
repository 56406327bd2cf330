"""Where an attention backend keeps each key and value element of a block in its paged cache.

The load side writes blobs into vLLM's cache through the backend's own cache write
(`impl.do_kv_cache_update`) and never needs the layout. The save side reads the cache, so it
needs it, and the layout is the backend's business: vLLM's CPU backend, for one, keeps a
block's keys transposed (`[head, dim, token]` inside `[num_blocks, kv_heads, block_size, 2 ·
head_size]`) and its values not, and other instruction sets pack them otherwise. So the layout
is learned from the same cache write the load side uses: a probe block of known numbers is
written through it into a scratch block, and where each number lands gives, for every key and
value element of a block, its offset in the block. The probe is checked to be a bijection;
anything else (a quantized cache, a write that mixes elements) is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

DIGIT = 64  # probe numbers are written digit by digit, 1..64: exact in every float dtype


class UnreadableCacheLayout(RuntimeError):
    """The backend's cache write is not a plain placement of each key and value element."""


@dataclass(frozen=True)
class BlockLayout:
    """Offsets, in a block flattened in its logical order, of keys and values [token, head,
    dim] (each a flat tensor of block_size · heads · head_size offsets)."""

    keys: torch.Tensor
    values: torch.Tensor
    heads: int
    head_size: int
    block_size: int

    def read(self, kv_cache: torch.Tensor, block_ids, start: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [heads, end − start, head_size] of a request's tokens start..end−1,
        whose blocks are `block_ids` in order (a copy, off the cache)."""
        bs = self.block_size
        blocks = torch.as_tensor(list(block_ids[:-(-end // bs)]), dtype=torch.long,
                                 device=kv_cache.device)
        flat = kv_cache[blocks].reshape(len(blocks), -1)

        def take(offsets: torch.Tensor) -> torch.Tensor:
            rows = flat[:, offsets.to(flat.device)].reshape(-1, self.heads, self.head_size)
            return rows[start:end].transpose(0, 1).contiguous()

        return take(self.keys), take(self.values)


WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_layout(write: WriteFn, kv_cache: torch.Tensor, heads: int, head_size: int,
                 block_size: int) -> BlockLayout:
    """The block layout that `write(keys, values, cache, slot_mapping)` — the backend's cache
    write, keys and values [tokens, heads, head_size] — gives a cache shaped like `kv_cache`
    (a logical [num_blocks, …] tensor; one scratch block is written, never the cache)."""
    scratch = torch.zeros_like(kv_cache[:1])
    n = block_size * heads * head_size
    codes = torch.arange(2 * n)  # keys' elements 0..n−1, values' n..2n−1, [token, head, dim]
    slots = torch.arange(block_size, device=kv_cache.device)
    found = torch.zeros(scratch.numel(), dtype=torch.long)
    written = torch.ones(scratch.numel(), dtype=torch.bool)
    scale = 1
    while scale < 2 * n:
        digit = ((codes // scale) % DIGIT + 1).to(device=kv_cache.device, dtype=kv_cache.dtype)
        scratch.zero_()
        write(digit[:n].view(block_size, heads, head_size),
              digit[n:].view(block_size, heads, head_size), scratch, slots)
        got = scratch.reshape(-1).to("cpu", torch.float32).round().long()
        written &= got > 0  # 0: a place the write did not touch (padding, another block)
        found += (got.clamp(min=1) - 1) * scale
        scale *= DIGIT
    offsets = written.nonzero().flatten()
    if offsets.numel() != 2 * n or not torch.equal(found[offsets].sort().values, codes):
        raise UnreadableCacheLayout(
            f"the attention backend's cache write does not place each of a block's {2 * n} key "
            f"and value elements once (it filled {offsets.numel()} places): this cache "
            "cannot be read back into blobs")
    where = torch.empty(2 * n, dtype=torch.long)
    where[found[offsets]] = offsets
    return BlockLayout(where[:n], where[n:], heads, head_size, block_size)
