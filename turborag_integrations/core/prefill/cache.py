"""A KV cache whose layers are preallocated buffers.

transformers' DynamicLayer grows by torch.cat, which copies the whole cache on every forward: at 4K
tokens of SmolLM2 that is 190 MB copied for each question prefill and each decoded token. Here each
layer owns a buffer with spare capacity; an update writes into it and returns views, and capacity
doubles only when it runs out. The stitcher also writes chunk caches straight into these buffers,
so assembly is a single copy per chunk.

`BatchArena` holds the caches of the requests decoded together (core/batching.py): row i of one
[layers, rows, heads, capacity, head_dim] pair of tensors per request, so that a batched decode
step attends over all of them in one call per layer (core/decode/batch.py).
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
        # CacheLayerMixin.__init__ assigns keys/values, which are views here; set state directly.
        self.storage = storage
        self.index = index
        self.length = 0
        self.device = storage.k.device
        self.is_initialized = True

    @property
    def keys(self) -> torch.Tensor:
        return self.storage.k[self.index, :, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self.storage.v[self.index, :, :, : self.length]

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

    def release(self, cache: KVCache) -> None:
        with self._lock:
            self._free.append(cache.storage)
            self._free.sort(key=lambda s: s.capacity, reverse=True)
            del self._free[self.keep:]


class _RowStorage(_Storage):
    """Row `row` of a `BatchArena`, seen as the storage of a one-row cache.

    `k`/`v` are views into the arena's tensors, looked up on each access: the arena may grow
    (new tensors) or move the row (compaction), and every layer of the cache follows."""

    def __init__(self, arena: "BatchArena", row: int):  # no buffers of its own
        self.arena = arena
        self.row = row

    @property
    def k(self) -> torch.Tensor:
        return self.arena.k[:, self.row: self.row + 1]

    @property
    def v(self) -> torch.Tensor:
        return self.arena.v[:, self.row: self.row + 1]

    def reserve(self, total: int, keep: int) -> None:
        self.arena.reserve(total)


class BatchArena:
    """The KV caches of the requests decoded together, as rows of one storage.

    A batched step over per-request storages pays one cache update and one attention call per
    request and layer (8 requests × 30 layers: 240 SDPA calls a step for SmolLM2). Here the rows
    in use are always rows 0..n-1 of one [layers, rows, heads, capacity, head_dim] pair, so one
    masked attention call per layer covers them all and one indexed write stores every row's new
    keys. `join` copies a prefilled cache into the next free row and returns a `KVCache` on that
    row (it behaves as any one-row cache: stitch, update, truncate); `leave` frees a row by
    moving the last row into it, so the rows in use stay 0..n-1.

    The tensors start zeroed and rows are reused: positions past a row's length hold finite
    values, so the attention mask that hides them (weights exactly 0) cannot meet a NaN.
    Capacity grows to what a joining request needs (all rows are copied then; rare).
    """

    def __init__(self, layers: int, rows: int, heads: int, head_dim: int,
                 dtype: torch.dtype, device, capacity: int = 1):
        if rows < 1:
            raise ValueError("a batch arena needs at least one row")
        self.k = torch.zeros((layers, rows, heads, max(capacity, 1), head_dim), dtype=dtype,
                             device=device)
        self.v = torch.zeros_like(self.k)
        self.caches: list[KVCache] = []  # the cache on row i, for the rows in use

    @classmethod
    def for_model(cls, model, rows: int, capacity: int = 1) -> "BatchArena":
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        return cls(config.num_hidden_layers, rows, config.num_key_value_heads, head_dim,
                   param.dtype, param.device, capacity)

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def in_use(self) -> int:
        return len(self.caches)

    def fits(self, cache: KVCache) -> bool:
        """Whether `cache` has this arena's layout (layers, heads, head_dim, dtype, device)."""
        s = cache.storage.k
        return ((s.shape[0], s.shape[2], s.shape[4]) == (self.k.shape[0], self.k.shape[2],
                                                          self.k.shape[4])
                and s.dtype == self.k.dtype and s.device == self.k.device)

    def reserve(self, total: int) -> None:
        """Room for `total` tokens in every row (the valid tokens of each row are kept)."""
        if total <= self.capacity:
            return
        keep = max((c.length for c in self.caches), default=0)
        capacity = max(total, 2 * self.capacity)
        self.k, self.v = (_grown(self.k, capacity, keep, torch.zeros),
                          _grown(self.v, capacity, keep, torch.zeros))

    def join(self, cache: KVCache, room: int = 0) -> KVCache:
        """A cache on the next free row holding a copy of `cache`'s tokens, with room for
        `room` more; `cache` itself is left as it was (give it back to its pool)."""
        if self.in_use == self.rows:
            raise RuntimeError(f"all {self.rows} rows of the batch arena are in use")
        if not self.fits(cache):
            raise ValueError("the cache's layout (layers, heads, head dim, dtype, device) is not "
                             "the arena's")
        if cache.storage.k.shape[1] != 1:
            raise ValueError("only a one-row cache can join a batch arena")
        n = cache.length
        if any(layer.length != n for layer in cache.layers):
            raise ValueError("a cache joins the arena between two forwards (all layers of "
                             "equal length)")
        self.reserve(n + room)
        row = KVCache(_RowStorage(self, self.in_use))
        k, v = row.slot(n)
        k.copy_(cache.storage.k[:, :, :, :n])
        v.copy_(cache.storage.v[:, :, :, :n])
        self.caches.append(row)
        return row

    def leave(self, cache: KVCache) -> None:
        """Free `cache`'s row: the last row in use moves into it (its cache follows)."""
        i = self.row_of(cache)
        last = self.caches.pop()
        if last is not cache:
            n = last.length
            self.k[:, i, :, :n] = self.k[:, last.storage.row, :, :n]
            self.v[:, i, :, :n] = self.v[:, last.storage.row, :, :n]
            last.storage.row = i
            self.caches[i] = last
        cache.storage = None  # a cache that left has no row to read
        for layer in cache.layers:
            layer.storage = None

    def row_of(self, cache: KVCache) -> int:
        storage = getattr(cache, "storage", None)
        if not isinstance(storage, _RowStorage) or storage.arena is not self \
                or storage.row >= self.in_use or self.caches[storage.row] is not cache:
            raise ValueError("the cache is not a row of this batch arena")
        return storage.row
