"""One end-to-end check on the real bundled SmolLM2-135M-Instruct."""

import pytest

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.generate import GenerationConfig

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
    engine = TurboRAGEngine(smollm2, store=tmp_path / "kv", cache_prefix=False)
    engine.encode_chunks([LIGHTHOUSE])
    prompt = LIGHTHOUSE + "\nQuestion: How high is the Tall Widow?\nAnswer:"
    config = GenerationConfig(max_new_tokens=12)
    turbo = engine.generate(prompt, chunks=[LIGHTHOUSE], config=config)
    naive = engine.generate(prompt, config=config, mode="naive")
    assert turbo.stats.reused_tokens > 30
    assert turbo.token_ids == naive.token_ids
