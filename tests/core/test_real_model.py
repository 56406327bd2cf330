"""One end-to-end check on the real bundled SmolLM2-135M-Instruct."""

import pytest

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.settings import GenerationConfig

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
    prompt = engine.render_chat([
        {"role": "system", "content": "Answer the question using only the context."},
        {"role": "user", "content": "Context:\n\n" + "\n\n".join(chunks)
         + "\n\nQuestion: How high is the Tall Widow lighthouse?"}])
    result = engine.generate(prompt, chunks=chunks, config=GenerationConfig(max_new_tokens=24))
    assert "38" in result.text
    stats = result.stats
    assert stats.cache_hits == 3 and stats.cache_misses == 0
    chunk_tokens = sum(len(engine.encoder.tokenize(c)) for c in chunks)
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


def test_bundled_model_gets_its_adapter_by_default(smollm2, tmp_path):
    from turborag_integrations.core.adapter import bundled_adapter
    from turborag_integrations.core.models import load_model

    shipped = bundled_adapter(smollm2.name)
    if shipped is None:
        pytest.skip("no adapter shipped for the bundled model in this checkout")
    adapted = TurboRAGEngine(smollm2, store=tmp_path / "kv")
    assert adapted.adapter == shipped
    plain = TurboRAGEngine(load_model(smollm2.name, progress=False), store=tmp_path / "kv",
                           adapter=None)
    assert plain.adapter is None
    assert plain.fingerprint.weights != adapted.fingerprint.weights
    assert plain.chunk_key(LIGHTHOUSE) != adapted.chunk_key(LIGHTHOUSE)
