"""Where a decode starts: the cache after the prompt, the logits of its last token, and the
position of the first new token: a prefill's `cache`, `logits` and `next_position`."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["DecodeStart"]


class DecodeStart(NamedTuple):
    cache: Any  # a KVCache (core/kv/cache.py), grown by each token decoding feeds back
    logits: torch.Tensor
    position: int
