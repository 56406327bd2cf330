"""Self-speculative decoding: quantised drafts, full-precision answers."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.conftest import tiny_model
from turborag_integrations.core.kv.cache import KVCache
from turborag_integrations.core.decode.matmul import int8_available
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.decode.loop import decode_loop
from turborag_integrations.core.decode.start import DecodeStart
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.decode.selfspec import DraftStats
from turborag_integrations.core.store import KVStore

MODES = ["bf16"] + (["int8"] if int8_available() else [])


def prefill(model, ids, capacity=64):
    cache = KVCache.empty(model, len(ids) + capacity)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1]


def decode(model, ids, config, stats=None, eos=()):
    cache, logits = prefill(model, ids, config.max_new_tokens + config.draft_tokens + 2)
    out = list(decode_loop(model, DecodeStart(cache, logits, len(ids)), config, set(eos),
                           draft_stats=stats))
    return out, cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("draft_tokens", [1, 3, 6])
def test_greedy_output_is_the_full_precision_output(tiny, mode, draft_tokens):
    model = tiny.model
    ids = tiny.tokenizer("The keeper of the lighthouse", add_special_tokens=False)["input_ids"]
    ref, _ = decode(model, ids, GenerationConfig(max_new_tokens=30))
    stats = DraftStats()
    got, cache = decode(model, ids, GenerationConfig(max_new_tokens=30, draft=mode,
                                                      draft_tokens=draft_tokens), stats)
    assert got == ref
    assert stats.drafted > 0 and 0 < stats.accepted <= stats.drafted
    assert stats.rounds >= (30 - 1) / (draft_tokens + 1)


def test_cache_holds_exact_entries_of_the_accepted_sequence(tiny_llama):
    """Invariant 5: after decoding, the cache equals a fresh full-precision prefill of the
    prompt and every generated token but the last (which is never fed)."""
    model = tiny_llama.model
    ids = tiny_llama.tokenizer("Harbour archive volume three", add_special_tokens=False)["input_ids"]
    got, cache = decode(model, ids, GenerationConfig(max_new_tokens=17, draft=MODES[-1],
                                                      draft_tokens=4))
    fresh, _ = prefill(model, ids + got[:-1])
    assert cache.length == fresh.length == len(ids) + len(got) - 1
    for a, b in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def test_sampling_is_reproducible_and_stops_at_eos(tiny_llama):
    model = tiny_llama.model
    ids = tiny_llama.tokenizer("Once", add_special_tokens=False)["input_ids"]
    config = GenerationConfig(max_new_tokens=40, temperature=1.0, seed=3, draft="bf16")
    a, _ = decode(model, ids, config)
    b, _ = decode(model, ids, config)
    assert a == b and len(a) == 40
    eos = a[10]  # pretend a token of the answer is the end-of-sequence token
    c, _ = decode(model, ids, config, eos=[eos])
    assert c == a[: a.index(eos)]


def test_validation_and_fallback(tiny_llama, caplog):
    with pytest.raises(ValueError, match="draft must be one of"):
        GenerationConfig(draft="int4")
    with pytest.raises(ValueError, match="not both"):
        GenerationConfig(draft="bf16", quantize="int8")
    with pytest.raises(ValueError, match="draft_tokens"):
        GenerationConfig(draft="bf16", draft_tokens=0)
    # a model the fast path cannot run decodes without drafts, with a warning
    loaded = tiny_model("llama", seed=5)
    loaded.model.train()
    ids = [5, 6, 7]
    with caplog.at_level(logging.WARNING):
        out, _ = decode(loaded.model, ids, GenerationConfig(max_new_tokens=5, draft="bf16"))
    assert len(out) == 5 and "drafting unavailable" in caplog.text


def test_engine_reports_draft_stats(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=KVStore(tmp_path), progress=False)
    chunk = "The lighthouse at Tall Widow Point is 38 meters high."
    prompt = "<s>user\n" + chunk + " How high?</s>\n<s>assistant\n"
    plain = engine.generate(prompt, chunks=[chunk], encode_missing=True,
                            config=GenerationConfig(max_new_tokens=12))
    drafted = engine.generate(prompt, chunks=[chunk],
                              config=GenerationConfig(max_new_tokens=12, draft="bf16"))
    assert drafted.token_ids == plain.token_ids
    stats = drafted.stats.as_dict()
    assert stats["drafted_tokens"] > 0 and 0 <= stats["draft_acceptance"] <= 1
    assert "drafted_tokens" not in plain.stats.as_dict()
