"""Lead blobs: a chunk encoded right after a prompt head is the full prefill's KV of the chunk
that follows that head, so a prompt's first chunk stitched from it is exact."""

import pytest
import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.prefill.recovery import parse_recovery

HEAD = "<s>system\nUse the context to answer.</s>\n<s>user\nContext:\n"
CHUNKS = ["Alice was born in Paris in 1901 and moved to Lyon.",
          "Bob keeps three red bicycles in his garage."]
QUESTION = "\nQ: where was Alice born?\nA:"


def last_logits(engine, prompt, chunks, **kwargs):
    segments, _, _ = engine.assembly.segments(prompt, chunks)
    return engine.prefill(segments, **kwargs).logits[-1].float(), segments


@pytest.fixture
def engine(tiny_llama, tmp_path):
    with TurboRAGEngine(tiny_llama, store=tmp_path / "kv", prompt_heads=[HEAD],
                        recovery="none") as made:
        made.encode_chunks(CHUNKS, doc_ids=["d1", "d2"])
        yield made


def test_first_chunk_after_a_known_head_is_the_full_prefill(engine):
    """One chunk: the stitched prompt's logits are the full prefill's. Two chunks: the lead
    blob gives what recomputing the first chunk (recovery "first") gives, at no query cost."""
    prompt = HEAD + CHUNKS[0] + QUESTION
    lead, segments = last_logits(engine, prompt, CHUNKS[:1])
    assert engine.library.is_lead(segments[1].blob) and segments[1].blob.base_position == len(
        engine.library.prompt_heads[0])
    full, _ = last_logits(engine, prompt, [])
    torch.testing.assert_close(lead, full, atol=1e-4, rtol=0)

    prompt = HEAD + "\n\n".join(CHUNKS) + QUESTION
    lead, _ = last_logits(engine, prompt, CHUNKS)
    other = TurboRAGEngine(engine.loaded, store=engine.store, recovery="none")  # no prompt heads
    usual, segments = last_logits(other, prompt, CHUNKS)
    assert not any(other.library.is_lead(s.blob) for s in segments)
    recomputed, _ = last_logits(other, prompt, CHUNKS, recovery=parse_recovery("first"))
    torch.testing.assert_close(lead, recomputed, atol=1e-4, rtol=0)
    assert (usual - recomputed).abs().max() > 1e-3  # the usual first blob is not exact


def test_only_the_first_chunk_after_that_very_head_uses_it(engine):
    cfg = GenerationConfig(max_new_tokens=2)
    known = engine.generate(HEAD + "\n\n".join(CHUNKS) + QUESTION, chunks=CHUNKS, config=cfg)
    assert known.stats.extra["lead_blob"] is True and known.stats.cache_hits == 2
    other = "<s>user\nRead this:\n" + "\n\n".join(CHUNKS) + QUESTION
    assert "lead_blob" not in engine.generate(other, chunks=CHUNKS, config=cfg).stats.extra
    segments, _, _ = engine.assembly.segments(HEAD + "\n\n".join(CHUNKS) + QUESTION, CHUNKS)
    # the head's own blob, the first chunk's lead blob, the separator's and the second chunk's
    assert [engine.library.is_lead(s.blob) for s in segments if s.cached] == [False, True, False, False]


def test_a_head_added_after_ingestion_encodes_lead_blobs_when_first_needed(tiny_llama, tmp_path):
    with TurboRAGEngine(tiny_llama, store=tmp_path / "kv", recovery="none") as engine:
        engine.encode_chunks(CHUNKS)
        before = set(engine.store.keys())
        ids = engine.library.add_prompt_head(HEAD)
        assert engine.library.prompt_heads == [ids]
        result = engine.generate(HEAD + CHUNKS[1] + QUESTION, chunks=CHUNKS[1:],
                                 config=GenerationConfig(max_new_tokens=2))
        assert result.stats.extra["lead_blob"] is True
        added = set(engine.store.keys()) - before
        assert len([k for k in added if k != engine.library.prefix_key(HEAD)]) == 1  # kept for next time


def test_a_lead_blob_made_when_first_needed_goes_with_its_chunks_documents(tiny_llama, tmp_path):
    with TurboRAGEngine(tiny_llama, store=tmp_path / "kv", recovery="none") as engine:
        engine.encode_chunks(CHUNKS, doc_ids=["d1", "d2"])
        engine.encode_chunks(CHUNKS[:1], doc_ids=["d3"])  # a chunk two documents share
        engine.library.add_prompt_head(HEAD)
        result = engine.generate(HEAD + CHUNKS[0] + QUESTION, chunks=CHUNKS[:1],
                                 config=GenerationConfig(max_new_tokens=2))
        assert result.stats.extra["lead_blob"] is True
        lead = next(k for k in engine.store.keys() if engine.library.is_lead(engine.store.get(k)))
        assert engine.forget_document("d1") == []  # d3 still uses the chunk and its lead blob
        assert sorted(engine.forget_document("d3")) == sorted([engine.library.chunk_key(CHUNKS[0]), lead])
        assert set(engine.store.keys()) - {engine.library.prefix_key(HEAD)} == {
            engine.library.chunk_key(CHUNKS[1])}


def test_lead_blobs_are_stored_once_and_go_with_their_document(engine):
    leads = [k for k in engine.store.keys() if engine.library.is_lead(engine.store.get(k))]
    assert len(leads) == 2
    engine.encode_chunks(CHUNKS, doc_ids=["d1", "d2"])  # nothing new
    assert len(engine.store.keys()) == 4
    engine.forget_document("d1")
    engine.forget_document("d2")
    assert engine.store.keys() == []


def test_prompt_head_from_a_rendered_template(engine):
    rendered = HEAD + "@@CONTEXT@@" + QUESTION
    assert engine.assembly.prompt_head(rendered, "@@CONTEXT@@") == HEAD
    with pytest.raises(ValueError, match="context marker"):
        engine.assembly.prompt_head(HEAD + QUESTION, "@@CONTEXT@@")
    with pytest.raises(ValueError, match="at least one token"):
        engine.library.add_prompt_head("")


def test_a_head_is_matched_as_a_prompt_tokenizes_it_before_a_chunk(tmp_path):
    """A BPE tokenizer with a "\\n\\n" token gives a head ending in a blank line one token
    alone, but two "\\n" before the chunk's first word: the head is registered as prompts
    have it, or no prompt would ever match it."""
    from tests.conftest import tiny_model

    loaded = tiny_model("llama", merges=(("Ċ", "Ċ"),))
    head = "<s>system\nAnswer from the context:\n\n"
    alone = loaded.tokenizer(head, add_special_tokens=False)["input_ids"]
    with TurboRAGEngine(loaded, store=tmp_path / "kv", prompt_heads=[head],
                        recovery="none") as engine:
        assert len(engine.library.prompt_heads[0]) == len(alone) + 1
        engine.encode_chunks(CHUNKS)
        prompt = head + CHUNKS[0] + QUESTION
        lead, segments = last_logits(engine, prompt, CHUNKS[:1])
        assert engine.library.is_lead(segments[1].blob)
        full, _ = last_logits(engine, prompt, [])
        torch.testing.assert_close(lead, full, atol=1e-4, rtol=0)


def test_first_chunk_recovery_is_skipped_over_a_lead_blob(engine):
    """`recovery="first"` recomputes a first chunk that a lead blob already makes exact: the
    engine leaves it out (same logits, nothing recomputed) and says so; other parts still run,
    sparing the lead blob's tokens."""
    cfg = GenerationConfig(max_new_tokens=2)
    prompt = HEAD + "\n\n".join(CHUNKS) + QUESTION
    plain = engine.generate(prompt, chunks=CHUNKS, config=cfg)
    first = engine.generate(prompt, chunks=CHUNKS, config=cfg, recovery="first")
    assert first.stats.extra["recovery"] == "none"
    assert first.stats.extra["recovery_asked"] == "first"
    assert first.stats.prefilled_tokens == plain.stats.prefilled_tokens
    assert first.token_ids == plain.token_ids
    both = engine.generate(prompt, chunks=CHUNKS, config=cfg, recovery="first,boundary:2")
    assert both.stats.extra["recovery"] == "boundary:2"
    other = TurboRAGEngine(engine.loaded, store=engine.store,
                           recovery="none")  # no heads: "first" runs
    # boundary:2 ran on every chunk but the lead blob's, whose 2 tokens are exact already
    edges = other.generate(prompt, chunks=CHUNKS, config=cfg, recovery="boundary:2")
    assert both.stats.prefilled_tokens == edges.stats.prefilled_tokens - 2
    assert both.stats.prefilled_tokens > plain.stats.prefilled_tokens
    ran = other.generate(prompt, chunks=CHUNKS, config=cfg, recovery="first")
    assert ran.stats.extra["recovery"] == "first" and "recovery_asked" not in ran.stats.extra
    assert ran.stats.prefilled_tokens > plain.stats.prefilled_tokens


def test_ingestion_progress_counts_the_lead_blobs(tiny_llama, tmp_path):
    """A progress bar of ingestion ends at every blob written: one per chunk, and one more per
    chunk and prompt head; what was stored before counts as done at once."""
    seen = []
    with TurboRAGEngine(tiny_llama, store=tmp_path / "kv", prompt_heads=[HEAD],
                        recovery="none") as engine:
        engine.encode_chunks(CHUNKS, progress=lambda done, total: seen.append((done, total)))
        assert seen[-1] == (4, 4) and {t for _, t in seen} == {4}
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # never backwards
        seen.clear()
        engine.encode_chunks(CHUNKS + ["Carol paints lighthouses."],
                             progress=lambda done, total: seen.append((done, total)))
        assert seen[0] == (2, 6) and seen[-1] == (6, 6)


def test_lead_blobs_are_encoded_in_token_bounded_batches_each_stored_as_made(tiny_llama, tmp_path,
                                                                           monkeypatch):
    """Memory follows a batch, not a document: each encoder call for lead blobs reads at most
    BATCH_TOKENS tokens (a longer chunk alone), and a batch's blobs are stored before the next
    batch is encoded."""
    from turborag_integrations.core.prefill import chunk_encoder

    monkeypatch.setattr(chunk_encoder, "BATCH_TOKENS", 48)
    texts = [f"Record {i}: the ferry of district {i} logged {17 * i} visitors on day {i}."
             for i in range(12)]
    with TurboRAGEngine(tiny_llama, store=tmp_path / "kv", prompt_heads=[HEAD],
                        recovery="none") as engine:
        head = len(engine.library.prompt_heads[0])
        calls, real = [], chunk_encoder.ChunkEncoder.encode_ids

        def spy(encoder, ids_list, *args, **kwargs):
            if len(encoder.anchor_ids) == head:  # the lead blobs' encoder
                stored = sum(1 for _ in engine.store.disk.keys())
                calls.append(([head + len(i) for i in ids_list], stored))
            return real(encoder, ids_list, *args, **kwargs)

        monkeypatch.setattr(chunk_encoder.ChunkEncoder, "encode_ids", spy)
        engine.encode_chunks(texts)
    assert len(calls) > 1
    assert all(sum(sizes) <= 48 or len(sizes) == 1 for sizes, _ in calls), calls
    assert sum(len(sizes) for sizes, _ in calls) == len(texts)
    stored = [n for _, n in calls]
    assert stored == sorted(stored) and stored[-1] > stored[0]  # earlier batches already stored
