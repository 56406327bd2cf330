"""Invariant 1: a chunk's keys re-rotated to offset d equal the chunk prefilled at offset d."""

import pytest
import torch

from tests.conftest import tiny_model
from turborag_integrations.core.errors import UnsupportedRopeError
from turborag_integrations.core.prefill.rope import KeyRotator

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
               "rope_theta": 500000.0},
}


def keys_at(model, ids, offset):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]),
                    position_ids=torch.arange(offset, offset + len(ids))[None], use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in out.cache.layers]


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
@pytest.mark.parametrize("offset", [1, 37, 1000])
def test_rerotated_keys_equal_prefill_at_offset(rope, model_type, offset):
    if model_type == "qwen2" and rope == "llama3":
        pytest.skip("llama3 RoPE is a Llama variant")
    loaded = tiny_model(model_type, rope_parameters=ROPES[rope])
    rotator = KeyRotator.for_model(loaded.model)
    ids = loaded.tokenizer("The quick brown fox jumps.", add_special_tokens=False)["input_ids"]
    at_zero = keys_at(loaded.model, ids, 0)
    at_offset = keys_at(loaded.model, ids, offset)
    for (k0, v0), (kd, vd) in zip(at_zero, at_offset):
        torch.testing.assert_close(rotator.rotate(k0, offset), kd, atol=1e-4, rtol=0)
        torch.testing.assert_close(v0, vd, atol=1e-4, rtol=0)


def test_rotation_by_zero_is_identity_and_rotation_composes(tiny_llama):
    rotator = KeyRotator.for_model(tiny_llama.model)
    k = torch.randn(2, 5, 16)
    assert torch.equal(rotator.rotate(k, 0), k)
    torch.testing.assert_close(rotator.rotate(rotator.rotate(k, 30), 12), rotator.rotate(k, 42),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(rotator.rotate(rotator.rotate(k, 30), -30), k, atol=1e-5, rtol=0)


def test_unsupported_rope_type_is_refused_by_name():
    loaded = tiny_model("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                   "rope_theta": 10000.0,
                                                   "original_max_position_embeddings": 512})
    with pytest.raises(UnsupportedRopeError, match="yarn"):
        KeyRotator.for_model(loaded.model)


def test_dynamic_rope_refused_beyond_original_window():
    loaded = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                   "rope_theta": 10000.0})
    rotator = KeyRotator.for_model(loaded.model)
    rotator.check_length(2048)
    with pytest.raises(UnsupportedRopeError, match="dynamic"):
        rotator.check_length(2049)
