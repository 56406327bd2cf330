"""The preallocated cache layer keeps transformers' layer contract."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.cache_utils import CacheLayerMixin

from turborag_integrations.core.kv.cache import KVCache, PreallocatedLayer, _Storage


def storage(capacity=4):
    return _Storage(layers=2, batch=1, heads=2, head_dim=3, capacity=capacity,
                    dtype=torch.float32, device="cpu")


def test_the_base_initialiser_runs():
    """Whatever the installed transformers sets up in a layer is there (keys and values are
    views of the storage instead)."""
    plain = SimpleNamespace()
    CacheLayerMixin.__init__(plain)  # the class is abstract: run its initialiser on a namespace
    base_attributes = set(vars(plain)) - {"keys", "values"}
    assert base_attributes  # is_initialized at least
    layer = PreallocatedLayer(storage(), 0)
    assert base_attributes <= set(vars(layer))
    assert layer.is_initialized and layer.length == 0


def test_updates_write_into_the_storage_and_grow_it():
    cache = KVCache(storage(capacity=2))
    k, v = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    keys, values = cache.layers[1].update(k, v)
    assert torch.equal(keys, k) and torch.equal(values, v)
    assert cache.storage.capacity >= 3  # grew past its first capacity
    assert torch.equal(cache.storage.k[1, :, :, :3], k)
    assert cache.layers[1].keys.data_ptr() == cache.storage.k[1].data_ptr()


def test_assigning_keys_or_values_is_refused():
    layer = PreallocatedLayer(storage(), 0)
    layer.keys = None  # what the base initialiser does: nothing to refuse
    with pytest.raises(AttributeError, match="views of its storage"):
        layer.keys = torch.zeros(1, 2, 1, 3)
    with pytest.raises(AttributeError, match="write through update"):
        layer.values = torch.zeros(1, 2, 1, 3)
