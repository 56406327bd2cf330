"""Context encoding (core/prefill/chunk_encoder.py, `context_tokens`): a chunk encoded after the
text before it in its document keeps exactly its own tokens' KV, computed as a causal forward
over anchor + context + chunk computes it; the context is part of the fingerprint; a prompt
whose chunks follow the very text they were encoded after stitches to the full prefill."""

import pytest
import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.prefill.context import DEFAULT_CONTEXT_TOKENS
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.transformers_api import output_cache

DOC = ["Alice was born in Paris in 1901.", "She moved to Lyon in 1925 and opened a bakery.",
       "It sold rye bread and almond cakes.", "The bakery closed in 1960."]


def causal_kv(loaded, ids: list[int]):
    """Keys and values [L, H, T, D] of one causal forward over `ids`."""
    with torch.inference_mode():
        out = loaded.model(input_ids=torch.tensor([ids]), use_cache=True)
    cache = output_cache(out)
    return (torch.stack([layer.keys[0] for layer in cache.layers]),
            torch.stack([layer.values[0] for layer in cache.layers]))


def test_blob_is_the_chunk_slice_of_a_causal_forward_after_anchor_and_context(tiny, tmp_path):
    """Invariant 7's encoding, exactly: every blob of a batch with contexts of different lengths
    (and none) equals the chunk's slice of its own forward over anchor + context + chunk, and
    records where that slice starts."""
    engine = TurboRAGEngine(tiny, store=tmp_path / "kv", context_tokens=12, progress=False)
    enc = engine.library.encoder
    engine.encode_chunks(DOC, contexts=[None, *DOC[:-1]])
    for before, text in zip([None, *DOC[:-1]], DOC):
        blob = engine.library.blob_for(text)
        ctx = enc.context_ids(before, len(enc.tokenize(text)))
        assert len(ctx) == (0 if before is None else 12)
        head = enc.anchor_ids + ctx
        assert blob.base_position == len(head)
        keys, values = causal_kv(tiny, head + enc.tokenize(text))
        torch.testing.assert_close(blob.keys, keys[:, :, len(head):], atol=1e-5, rtol=0)
        torch.testing.assert_close(blob.values, values[:, :, len(head):], atol=1e-5, rtol=0)
    # and the context matters: the second chunk alone has other values
    alone = TurboRAGEngine(tiny, store=tmp_path / "kv0", progress=False).library.encoder.encode(DOC[1])
    # (encode without contexts: alone, whatever the engine's context_tokens)
    assert (alone.values - engine.library.blob_for(DOC[1]).values).abs().max() > 1e-3


def test_context_is_the_end_of_the_text_before_and_the_join(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", context_tokens=10, progress=False)
    tok, enc = engine.tokenizer, engine.library.encoder
    ids = enc.context_ids(DOC[0] + "  \n")  # trailing whitespace gives way to the join
    assert tok.decode(ids) == (DOC[0] + "\n\n")[-10:]  # byte tokenizer: a token per byte
    assert enc.context_ids(None) == enc.context_ids("  \n") == []
    # the window bounds anchor + context + chunk: a long chunk leaves less room for context
    room = enc.max_chunk_tokens - 5
    assert len(enc.context_ids(DOC[0] * 3, chunk_len=room)) == 5
    assert enc.context_ids(DOC[0], chunk_len=enc.max_chunk_tokens) == []


def test_context_is_part_of_fingerprint_and_key(tiny_llama, tmp_path):
    """Blobs made with a context are never used by an engine that encodes otherwise."""
    store = tmp_path / "kv"
    with_ctx = TurboRAGEngine(tiny_llama, store=store, context_tokens=64, progress=False)
    other = TurboRAGEngine(tiny_llama, store=store, context_tokens=32, progress=False)
    alone = TurboRAGEngine(tiny_llama, store=store, context_tokens=0, progress=False)
    assert with_ctx.fingerprint.encoding.endswith("+context:64")
    assert TurboRAGEngine(tiny_llama, store=store, progress=False).library.encoder.context_tokens == \
        DEFAULT_CONTEXT_TOKENS > 0  # on by default
    assert "context" not in alone.fingerprint.encoding
    assert len({e.fingerprint.id for e in (with_ctx, other, alone)}) == 3
    with_ctx.encode_chunks(DOC[:2], contexts=[None, DOC[0]])
    assert with_ctx.library.blob_for(DOC[1]) is not None
    assert other.library.blob_for(DOC[1]) is None and alone.library.blob_for(DOC[1]) is None
    # a chunk stored already keeps its blob, whatever came before it this time
    before = with_ctx.library.blob_for(DOC[1]).keys.clone()
    with_ctx.encode_chunks([DOC[1]], contexts=[DOC[3]])
    assert torch.equal(with_ctx.library.blob_for(DOC[1]).keys, before)


def test_chunks_after_their_own_context_stitch_to_the_full_prefill(tiny, tmp_path):
    """A prompt that is the document itself, chunk after chunk, with everything before each
    chunk as its context: every stitched token's KV is the causal one, so the stitched reply is
    the full prefill's token for token, where chunks encoded alone give other logits."""
    prompt = "\n\n".join(DOC) + "\nQ: where did Alice open a bakery?\nA:"
    config = GenerationConfig(max_new_tokens=16)
    contexts = [None] + ["\n\n".join(DOC[:i]) for i in range(1, len(DOC))]
    engine = TurboRAGEngine(tiny, store=tmp_path / "kv", anchor="none", separators=False,
                            context_tokens=10_000, progress=False)
    engine.encode_chunks(DOC, contexts=contexts)
    turbo = engine.generate(prompt, chunks=DOC, config=config)
    naive = engine.generate(prompt, chunks=DOC, config=config, mode="naive")
    assert turbo.stats.cache_hits == len(DOC)
    assert turbo.token_ids == naive.token_ids and turbo.token_ids
    segments, _, _ = engine.assembly.segments(prompt, DOC)
    pre = engine.prefill(segments, reserve=1)
    alone = TurboRAGEngine(tiny, store=tmp_path / "kv0", anchor="none", separators=False,
                           progress=False)
    alone.encode_chunks(DOC)
    pre0 = alone.prefill(alone.assembly.segments(prompt, DOC)[0], reserve=1)
    with torch.inference_mode():
        full = tiny.model(input_ids=torch.tensor([tiny.tokenizer(
            prompt, add_special_tokens=False)["input_ids"]])).logits[0, -1]
    torch.testing.assert_close(pre.logits.reshape(-1), full, atol=1e-4, rtol=0)
    assert (pre0.logits.reshape(-1) - full).abs().max() > 1e-3
    engine.cache_pool.release(pre.cache)
    alone.cache_pool.release(pre0.cache)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "64"])
def test_bad_context_tokens_are_refused(tiny_llama, tmp_path, bad):
    with pytest.raises(ValueError, match="context_tokens"):
        TurboRAGEngine(tiny_llama, store=tmp_path / "kv", context_tokens=bad, progress=False)


def test_contexts_must_pair_with_chunks(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", context_tokens=8, progress=False)
    with pytest.raises(ValueError, match="2 contexts for 3 chunks"):
        engine.encode_chunks(DOC[:3], contexts=[None, DOC[0]])


def test_the_overlap_a_splitter_repeats_is_not_context():
    """Splitters overlap consecutive chunks: the text before a chunk is what precedes the part
    it repeats; a short coincidental match is kept."""
    from turborag_integrations.core.prefill.context import without_overlap

    before = "The ferry ran daily. It stopped in January when the harbour froze over."
    chunk = "It stopped in January when the harbour froze over. It resumed in March."
    assert without_overlap(before, chunk) == "The ferry ran daily. "
    assert without_overlap("It ends with froze.", "froze. Then more.") == "It ends with froze."
    assert without_overlap(before, "Unrelated text.") == before


def test_contexts_skip_the_overlap_with_the_chunk(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", context_tokens=64, progress=False)
    overlapped = DOC[0] + " " + DOC[1]
    chunk = DOC[1] + " " + DOC[2]
    assert engine.library.encoder.context_ids(overlapped, chunk=chunk) == \
        engine.library.encoder.context_ids(DOC[0] + " ")
    engine.encode_chunks([chunk], contexts=[overlapped])
    [alone] = engine.library.encoder.encode_many([chunk], contexts=[DOC[0]])
    torch.testing.assert_close(engine.library.blob_for(chunk).keys, alone.keys, atol=1e-5, rtol=0)


def test_the_text_before_a_chunk_is_its_documents_pieces_so_far():
    """Every piece before, nearest last, each less the overlap with the next, joined by blank
    lines, only the end that the context can hold."""
    from turborag_integrations.core.prefill.context import (CHARS_PER_TOKEN, document_contexts,
                                                            text_before)

    pieces = ["Chapter one. The ferry ran daily from Velmora harbour.",
              "from Velmora harbour. It stopped in January.",  # overlaps the piece before
              "The harbour froze that winter."]
    contexts = document_contexts(pieces, 100)
    assert contexts[0] is None
    assert contexts[1] == "Chapter one. The ferry ran daily"  # the overlap trimmed
    assert contexts[2] == "Chapter one. The ferry ran daily\n\nfrom Velmora harbour. It " \
                          "stopped in January."
    assert document_contexts(pieces, 0) == [None, None, None]
    short = text_before(reversed(pieces[:2]), pieces[2], 1)
    assert short == contexts[2][-CHARS_PER_TOKEN:]  # only as much as one token can hold


def test_ingestion_replaces_blobs_encoded_alone_with_context_blobs(tiny, tmp_path):
    """A chunk retrieved before its document was ingested with context (a store from an older
    release, or a LlamaIndex postprocessor's `encode_missing`) was encoded alone at query time;
    ingesting its document later replaces that blob with the one after its context, and leaves
    blobs that already had one (or need none) as they are."""
    engine = TurboRAGEngine(tiny, store=tmp_path / "kv", context_tokens=12, progress=False)
    alone_at = engine.library.encoder.base_position
    engine.library.prepare_chunks([DOC[0], DOC[1]])  # query time: no document, so encoded alone
    assert engine.library.blob_for(DOC[1]).base_position == alone_at
    first = engine.library.blob_for(DOC[0]).keys.clone()
    writes = engine.store.stats().writes

    engine.encode_chunks(DOC, contexts=[None, *DOC[:-1]], doc_ids=["d"] * 4)
    fresh = TurboRAGEngine(tiny, store=tmp_path / "kv2", context_tokens=12, progress=False)
    fresh.encode_chunks(DOC, contexts=[None, *DOC[:-1]])
    for text in DOC:
        got, want = engine.library.blob_for(text), fresh.library.blob_for(text)
        assert got.base_position == want.base_position
        assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert engine.library.blob_for(DOC[1]).base_position > alone_at
    # the document's first chunk has no context: its blob stayed, not rewritten
    assert torch.equal(engine.library.blob_for(DOC[0]).keys, first)
    assert engine.store.stats().writes == writes + 3  # DOC[1] replaced, DOC[2:] new
    assert sorted(engine.forget_document("d")) == sorted(engine.library.chunk_key(t) for t in DOC)

    # an engine without context encoding never replaces anything
    plain = TurboRAGEngine(tiny, store=tmp_path / "kv3", context_tokens=0, progress=False)
    plain.library.prepare_chunks([DOC[1]])
    writes = plain.store.stats().writes
    plain.encode_chunks(DOC[:2], contexts=[None, DOC[0]])
    assert plain.store.stats().writes == writes + 1  # DOC[0] only
