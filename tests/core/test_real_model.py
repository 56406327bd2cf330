"""One end-to-end check on the real bundled SmolLM2-135M-Instruct."""

import pytest

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.prompt_template import render_chat

pytestmark = pytest.mark.real_model

LIGHTHOUSE = ("Velmora's lighthouse, the Tall Widow, stands at the end of the Grey Spine. It is 38 "
              "metres high, was first lit in 1859, and its light can be seen from 24 nautical "
              "miles away.")
DISTRACTORS = [
    "The Orbital Kiln Company employs about 320 people. Its main factory is in Brannock, on the "
    "site of a former brick works.",
    "The Haldor Glacier expedition of 1957 was led by the geologist Margit Eskelund and lasted "
    "63 days.",
]


def test_question_answered_from_three_stitched_chunks(smollm2, tmp_path):
    engine = TurboRAGEngine(smollm2, store=tmp_path / "kv")
    chunks = [DISTRACTORS[0], LIGHTHOUSE, DISTRACTORS[1]]
    engine.encode_chunks(chunks)
    prompt = render_chat(engine.tokenizer, [
        {"role": "system", "content": "Answer the question using only the context."},
        {"role": "user", "content": "Context:\n\n" + "\n\n".join(chunks)
         + "\n\nQuestion: How high is the Tall Widow lighthouse?"}])
    result = engine.generate(prompt, chunks=chunks, config=GenerationConfig(max_new_tokens=24))
    assert "38" in result.text
    stats = result.stats
    assert stats.cache_hits == 3 and stats.cache_misses == 0
    chunk_tokens = sum(len(engine.library.encoder.tokenize(c)) for c in chunks)
    assert stats.reused_tokens >= chunk_tokens
    assert stats.prefilled_tokens < 40  # the question and the template's glue, nothing more


def test_single_chunk_turbo_equals_full_prefill_on_real_model(smollm2, tmp_path):
    """Right after the text it was encoded after (the chat anchor), a chunk is exact."""
    engine = TurboRAGEngine(smollm2, store=tmp_path / "kv", cache_prefix=False)
    assert engine.anchor_text.startswith("<|im_start|>system")
    engine.encode_chunks([LIGHTHOUSE])
    prompt = engine.anchor_text + LIGHTHOUSE + "\nQuestion: How high is the Tall Widow?\nAnswer:"
    config = GenerationConfig(max_new_tokens=12)
    turbo = engine.generate(prompt, chunks=[LIGHTHOUSE], config=config)
    naive = engine.generate(prompt, config=config, mode="naive")
    assert turbo.stats.reused_tokens > 30
    assert turbo.token_ids == naive.token_ids


def test_bundled_model_is_unmodified_by_default(smollm2, tmp_path):
    """The query-time model is the weights as loaded: the engine changes none of them."""
    from turborag_integrations.core.kv.blob import weights_digest

    digest = weights_digest(smollm2.model)
    engine = TurboRAGEngine(smollm2, store=tmp_path / "kv")
    assert engine.fingerprint.weights == digest == weights_digest(engine.model)


def test_bundled_encoder_is_loaded_by_default_and_never_changes_a_full_prefill(smollm2, tmp_path):
    """The shipped chunk encoder acts only on chunk blobs: a full prefill with it answers token
    for token as the model alone, and its blobs carry its digest."""
    from turborag_integrations.core.prefill.encoding import bundled_encoder

    if bundled_encoder(smollm2.name) is None:
        pytest.skip("no encoder shipped for the bundled model in this checkout")
    with_enc = TurboRAGEngine(smollm2, store=tmp_path / "kv")
    plain = TurboRAGEngine(smollm2, store=tmp_path / "kv", encoder=None)
    assert with_enc.learned is not None and "+enc:" in with_enc.fingerprint.encoding
    assert with_enc.library.chunk_key(LIGHTHOUSE) != plain.library.chunk_key(LIGHTHOUSE)
    prompt = render_chat(with_enc.tokenizer, [{"role": "user", "content": LIGHTHOUSE + "\nHow high is the "
                                    "Tall Widow?"}])
    config = GenerationConfig(max_new_tokens=8)
    assert with_enc.generate(prompt, config=config, mode="naive").token_ids == \
        plain.generate(prompt, config=config, mode="naive").token_ids
    with_enc.encode_chunks([LIGHTHOUSE])
    turbo = with_enc.generate(prompt, chunks=[LIGHTHOUSE], config=config)
    assert turbo.stats.cache_hits == 1 and turbo.stats.reused_tokens > 30
    # the same weights loaded from a folder (as vLLM's connector loads them) get the same
    # encoder, found by the weights it was trained for: their blobs are the same blobs
    from dataclasses import replace

    from turborag_integrations.core.models import LoadedModel

    as_folder = TurboRAGEngine(replace(smollm2, name="/some/folder/of/it"),
                               store=tmp_path / "kv")
    assert isinstance(smollm2, LoadedModel) and as_folder.learned is not None
    assert as_folder.fingerprint.id == with_enc.fingerprint.id
