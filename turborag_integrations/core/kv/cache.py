"""A KV cache whose layers are preallocated buffers.

transformers' DynamicLayer grows by torch.cat, which copies the whole cache on every forward: at 4K
tokens of SmolLM2 that is 190 MB copied for each question prefill and each decoded token. Here each
layer owns a buffer with spare capacity; an update writes into it and returns views, and capacity
doubles only when it runs out. The stitcher also writes chunk caches straight into these buffers,
so assembly is a single copy per chunk.

The caches of requests decoded together are rows of one `BatchArena` (core/kv/arena.py).
"""

from __future__ import annotations

import threading

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _grown(old: torch.Tensor, capacity: int, keep: int, make) -> torch.Tensor:
    """A copy of `old` [layers, batch, heads, capacity, dim] with room for `capacity` tokens
    and its first `keep` tokens; `make` (torch.empty or torch.zeros) fills the rest."""
    # Growth happens mid-forward, under inference mode; tensors made there could not be
    # written outside it later, and storage is handed out again. Make normal ones.
    with torch.inference_mode(False):
        grown = make(old.shape[:3] + (capacity, old.shape[4]), dtype=old.dtype, device=old.device)
        grown[:, :, :, :keep] = old[:, :, :, :keep]
    return grown


class _Storage:
    """Keys and values of all layers in two tensors [layers, batch, heads, capacity, head_dim].

    One tensor for all layers lets the stitcher write a chunk's every layer in one operation.
    """

    def __init__(self, layers: int, batch: int, heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device):
        shape = (layers, batch, heads, max(capacity, 1), head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, total: int, keep: int) -> None:
        if total <= self.capacity:
            return
        capacity = max(total, 2 * self.capacity)
        self.k, self.v = (_grown(self.k, capacity, keep, torch.empty),
                          _grown(self.v, capacity, keep, torch.empty))


class PreallocatedLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, storage: _Storage, index: int):
        self.storage = storage
        self.index = index
        self.length = 0
        # The base initialiser runs, so whatever a transformers version adds there is set; it
        # clears keys and values, which the setters below accept as a no-op.
        super().__init__()
        self.device = storage.k.device
        self.is_initialized = True  # the buffers exist already

    @property
    def keys(self) -> torch.Tensor:
        return self.storage.k[self.index, :, :, : self.length]

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor:
        return self.storage.v[self.index, :, :, : self.length]

    @values.setter
    def values(self, value) -> None:
        self._refuse_assignment("values", value)

    @staticmethod
    def _refuse_assignment(name: str, value) -> None:
        # keys and values are views of the storage: a tensor assigned in their place would be
        # silently out of step with it
        if value is not None:
            raise AttributeError(f"a PreallocatedLayer's {name} are views of its storage: "
                                 "write through update() or append()")

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        n = keys.shape[-2]
        # Other layers may hold more tokens mid-forward; keep all of them when growing.
        self.storage.reserve(self.length + n, keep=self.storage.capacity)
        self.storage.k[self.index, :, :, self.length: self.length + n] = keys
        self.storage.v[self.index, :, :, self.length: self.length + n] = values
        self.length += n

    # --- CacheLayerMixin interface -------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist already
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.append(key_states, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last -tokens_to_remove tokens (transformers 5 convention: n <= 0).

        The layer interface transformers calls; our own code shortens a cache with
        `KVCache.truncate`."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a non-positive count of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        self.length = 0


class KVCache(Cache):
    """A transformers Cache whose layers are views into one preallocated storage."""

    def __init__(self, storage: _Storage):
        self.storage = storage
        super().__init__(layers=[PreallocatedLayer(storage, i) for i in range(storage.k.shape[0])])

    @classmethod
    def empty(cls, model, capacity: int, batch: int = 1) -> "KVCache":
        config = model.config
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        return cls(_Storage(config.num_hidden_layers, batch, heads, head_dim, capacity,
                            param.dtype, param.device))

    @property
    def length(self) -> int:
        return self.layers[0].length

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.k.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.k.device

    def reserve(self, total: int) -> None:
        self.storage.reserve(total, keep=self.length)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens (the one way our code shortens a cache: O(1), the
        buffers stay)."""
        for layer in self.layers:
            layer.length = min(layer.length, length)

    def export(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host copies of the first n tokens' keys and values, [layers, kv_heads, n, head_dim]
        (batch row 0): the tensors of a KV blob."""
        return (self.storage.k[:, 0, :, :n].clone().cpu(),
                self.storage.v[:, 0, :, :n].clone().cpu())

    def slot(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Claim the next n positions in every layer; return writable [layers, batch, heads, n, dim]
        views of them."""
        start = self.length
        self.reserve(start + n)
        for layer in self.layers:
            layer.length = start + n
        return self.storage.k[:, :, :, start: start + n], self.storage.v[:, :, :, start: start + n]

    def clone(self) -> "KVCache":
        """An independent copy of the valid tokens (with the same spare room)."""
        s = self.storage
        copy = KVCache(_Storage(s.k.shape[0], s.k.shape[1], s.k.shape[2], s.k.shape[4],
                                s.capacity, s.k.dtype, s.k.device))
        k, v = copy.slot(self.length)
        k.copy_(s.k[:, :, :, : self.length])
        v.copy_(s.v[:, :, :, : self.length])
        return copy


class CachePool:
    """Hands out cache storage again after use.

    A fresh buffer for a 4K-token SmolLM2 cache is 190 MB of untouched pages; faulting them in
    costs about 0.1 s on these CPUs, more than stitching the chunks into it. Reusing the storage
    of the previous call removes that from every query but the first.
    """

    def __init__(self, keep: int = 1):
        self.keep = keep
        self._free: list[_Storage] = []
        self._lock = threading.Lock()

    def acquire(self, model, capacity: int) -> KVCache:
        config = model.config
        param = next(model.parameters())
        with self._lock:
            for i, storage in enumerate(self._free):
                k = storage.k
                if (storage.capacity >= capacity and k.dtype == param.dtype
                        and k.device == param.device and k.shape[0] == config.num_hidden_layers
                        and k.shape[2] == config.num_key_value_heads):
                    return KVCache(self._free.pop(i))
        return KVCache.empty(model, capacity)

    def keep_at_least(self, n: int) -> None:
        """Keep at least `n` free storages (a scheduler with n caches in use at once)."""
        with self._lock:
            self.keep = max(self.keep, n)

    def release(self, cache: KVCache) -> None:
        with self._lock:
            self._free.append(cache.storage)
            self._free.sort(key=lambda s: s.capacity, reverse=True)
            del self._free[self.keep:]
