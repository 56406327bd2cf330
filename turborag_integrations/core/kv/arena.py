"""`BatchArena` holds the caches of the requests decoded together (core/batching.py): row i of one
[layers, rows, heads, capacity, head_dim] pair of tensors per request, so that a batched decode
step attends over all of them in one call per layer (core/decode/batch.py).
"""

from __future__ import annotations

import torch

from .cache import KVCache, _grown, _Storage

__all__ = ["BatchArena"]


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
        self._row_ids = torch.arange(rows, device=device)  # indexes of the per-step write

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

    def holds(self, cache: KVCache) -> bool:
        """Whether `cache` is a row in use of this arena."""
        storage = getattr(cache, "storage", None)
        return (isinstance(storage, _RowStorage) and storage.arena is self
                and storage.row < self.in_use and self.caches[storage.row] is cache)

    def row_of(self, cache: KVCache) -> int:
        if not self.holds(cache):
            raise ValueError("the cache is not a row of this batch arena")
        return cache.storage.row

    @staticmethod
    def of(caches) -> "BatchArena | None":
        """The arena whose rows in use are exactly `caches` (in any order), else None."""
        storage = getattr(caches[0], "storage", None) if caches else None
        arena = storage.arena if isinstance(storage, _RowStorage) else None
        if arena is None or arena.in_use != len(caches) \
                or {id(c) for c in caches} != {id(c) for c in arena.caches}:
            return None
        return arena

    def append_token(self, layer: int, k: torch.Tensor, v: torch.Tensor, at: torch.Tensor,
                     span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step's keys and values of `layer` ([rows in use, heads, 1, dim], row i's
        written at position at[i]), counted in every row's cache; returns that layer's keys and
        values over the first `span` positions of the rows in use. One indexed write for all
        rows: the batched step's cache update (core/decode/batch.py)."""
        b = self.in_use
        rows = self._row_ids[:b]
        keys, values = self.k[layer], self.v[layer]  # [rows, heads, capacity, dim]
        keys[rows, :, at] = k[:, :, 0]
        values[rows, :, at] = v[:, :, 0]
        for cache in self.caches:
            cache.layers[layer].length += 1
        return keys[:b, :, :span], values[:b, :, :span]
