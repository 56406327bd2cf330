"""Invariant 1: a chunk's keys re-rotated to offset d equal the chunk prefilled at offset d; the
RoPE variants that cannot be re-rotated are refused, and dynamic RoPE only within its window."""

import pytest
import torch

from tests.conftest import tiny_model
from tests.core.prefill.test_stitch import (ANCHOR, LAYOUTS, assert_cache_equals_masked_forward,
                                    assert_logits_equal_masked_forward, build)
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.errors import UnsupportedRopeError
from turborag_integrations.core.prefill.rope import KeyRotator
from turborag_integrations.core.prefill.stitch import plan_prompt, prefill
from turborag_integrations.core.settings import GenerationConfig

# YaRN with its default attention factor, 0.1·ln(4) + 1 ≈ 1.14: transformers multiplies cos and
# sin by it, so every cached key carries it and a re-rotation must not apply it again.
YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 512}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
               "rope_theta": 500000.0},
    "yarn": YARN,
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


def test_yarn_attention_factor_is_in_the_cached_keys():
    """The premise of the YaRN cases: its cos/sin scale is not 1, so a rotator that applied it
    again (or a model that did not) would be off by 14% in every key."""
    loaded = tiny_model("llama", rope_parameters=YARN)
    scale = loaded.model.model.rotary_emb.attention_scaling
    assert scale == pytest.approx(1.0 + 0.1 * torch.log(torch.tensor(4.0)).item())
    ids = loaded.tokenizer("abc", add_special_tokens=False)["input_ids"]
    plain = tiny_model("llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    # position 0 is the identity rotation: the only difference left is the scale
    (k_yarn, _), *_ = keys_at(loaded.model, ids[:1], 0)
    (k_plain, _), *_ = keys_at(plain.model, ids[:1], 0)
    torch.testing.assert_close(k_yarn, scale * k_plain, atol=1e-5, rtol=0)


@pytest.mark.parametrize("anchor", ["", ANCHOR])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_yarn_stitched_logits_equal_full_prefill(model_type, layout, anchor):
    """Invariant 2 on a YaRN model: the stitched prompt's logits equal one forward over the whole
    prompt under the independent-attention mask."""
    assert_logits_equal_masked_forward(tiny_model(model_type, rope_parameters=YARN), layout,
                                       anchor)


def test_yarn_stitched_cache_equals_full_prefill_cache():
    """Every key and value of the stitched YaRN cache, chunks moved to their offsets included,
    equals the one a full prefill under the mask computes at the same position."""
    loaded = tiny_model("llama", rope_parameters=YARN)
    fp, segs = build(loaded, LAYOUTS["prefix_glue_chunks"])
    plan = plan_prompt(segs, loaded.tokenizer, fingerprint=fp)
    assert all(s.position_start > 0 for s in plan.spans)  # every chunk is re-rotated
    stitched = prefill(loaded.model, plan, KeyRotator.for_model(loaded.model))
    assert_cache_equals_masked_forward(loaded, plan, stitched)


def test_longrope_is_refused_with_the_reason():
    loaded = tiny_model("llama", rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 512,
        "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    with pytest.raises(UnsupportedRopeError) as info:
        KeyRotator.for_model(loaded.model)
    message = str(info.value)
    assert "'longrope'" in message
    assert "short and long factors" in message and "length of the whole sequence" in message
    assert "'yarn'" in message  # what to use instead


def test_dynamic_rope_check_follows_transformers_rule():
    """transformers rescales dynamic RoPE once a forward's largest position reaches the window
    (seq_len = max position + 1 > max_position_embeddings): positions 0..2047 of a 2048 window
    keep the original frequencies, position 2048 does not. check_length counts positions the
    same way."""
    loaded = tiny_model("llama", rope_parameters=DYNAMIC)
    rotary = loaded.model.model.rotary_emb
    original = rotary.original_inv_freq.clone()
    rotator = KeyRotator.for_model(loaded.model)
    x = torch.zeros(1, 1, 64)
    rotary(x, torch.tensor([[2047]]))
    assert torch.equal(rotary.inv_freq, original)
    rotator.check_length(2048)
    rotary(x, torch.tensor([[2048]]))
    assert not torch.equal(rotary.inv_freq, original)
    with pytest.raises(UnsupportedRopeError, match="dynamic.*2048"):
        rotator.check_length(2049)


def test_dynamic_rope_generation_that_fills_the_window_runs(tmp_path):
    """A prompt of P tokens and P + n = 2048 new ones uses positions 0..2047 only (the last new
    token is never even fed back): it fits the original window and must run, cached chunk and
    all, and give the tokens of transformers' own greedy generation. Asking for more is clipped
    to the window, as for every other RoPE type."""
    loaded = tiny_model("llama", rope_parameters=DYNAMIC)
    engine = TurboRAGEngine(loaded, store=tmp_path / "kv", anchor="chat")
    chunk = "Alice was born in Paris in 1901."
    engine.encode_chunks([chunk])
    head = engine.anchor_text + chunk + "\nQ: "
    n_head = len(engine.tokenizer(head + "\nA:", add_special_tokens=False)["input_ids"])
    # one token per byte: a question that leaves room for 12 new tokens
    prompt = head + ("where was she born? " * 120)[:2048 - 12 - n_head] + "\nA:"
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    room = loaded.context_window - len(ids)
    assert loaded.context_window == 2048 and room == 12
    with torch.inference_mode():
        expected = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                         max_new_tokens=room, do_sample=False,
                                         eos_token_id=None)[0, len(ids):].tolist()
    assert len(expected) == room
    for asked in (room, room + 5):
        config = GenerationConfig(max_new_tokens=asked)
        turbo = engine.generate(prompt, chunks=[chunk], config=config)
        assert turbo.stats.reused_tokens > 0
        stop = next((i for i, t in enumerate(expected) if t in engine.eos_ids), room)
        assert turbo.token_ids == expected[:stop]
