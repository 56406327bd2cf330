"""Learned chunk encoding (core/prefill/encoding.py): the engine's stitched prompt over blobs made
with soft tokens and an encode-only LoRA equals the training forward that defines it; the
query-time model is unchanged; the encoder is part of the fingerprint; bad files are refused."""

import pytest
import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.errors import EncoderMismatch
from turborag_integrations.core.prefill.anchor import anchor_ids
from turborag_integrations.core.kv.blob import fingerprint_model
from turborag_integrations.core.prefill.encoding import LearnedEncoding, new_lora
from turborag_integrations.training.distill import make_example, student_logits
from tests.conftest import tiny_model
from turborag_integrations.core.prompt_template import render_chat

CHUNKS = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles.",
          "The river Xan flows north to the sea."]


def encoding_for(loaded, *, soft: int = 3, rank: int = 4, seed: int = 1) -> LearnedEncoding:
    fp = fingerprint_model(loaded.model, loaded.tokenizer, loaded.name)
    gen = torch.Generator().manual_seed(seed)
    hidden = loaded.model.config.hidden_size
    lora = new_lora(loaded.model, rank, seed=seed) if rank else {}
    # trained deltas are not zero: give B random values so the LoRA really acts
    lora = {name: (a.detach(), torch.randn(b.shape, generator=gen) * 0.2, s)
            for name, (a, b, s) in lora.items()}
    return LearnedEncoding(soft=torch.randn(soft, hidden, generator=gen) if soft else None,
                           lora=lora, base_weights=fp.weights, tokenizer=fp.tokenizer,
                           anchor="chat")


def prompt_of(engine, question="Where was Alice born?"):
    user = "Context:\n" + "\n\n".join(CHUNKS) + f"\n\nQuestion: {question}"
    return render_chat(engine.tokenizer, [{"role": "system", "content": "Use the context."},
                               {"role": "user", "content": user}])


@pytest.mark.parametrize("soft,rank", [(3, 0), (0, 4), (3, 4)])
def test_stitched_logits_equal_the_training_forward(tiny, tmp_path, soft, rank):
    """Invariant 2 with a learned encoding: blobs encoded with soft tokens and the LoRA on, then
    stitched and prefilled with the plain model, give the logits of the one masked forward that
    training optimises (the LoRA on the chunk spans only, the soft tokens in each span's head)."""
    enc = encoding_for(tiny, soft=soft, rank=rank)
    engine = TurboRAGEngine(tiny, store=str(tmp_path / "kv"), progress=False, encoder=enc,
                            recovery="none")
    engine.encode_chunks(CHUNKS)
    prompt = prompt_of(engine)
    segments, hits, _ = engine.assembly.segments(prompt, CHUNKS)
    assert hits == len(CHUNKS)
    pre = engine.prefill(segments, reserve=4)
    reply = "Paris"
    tok = tiny.tokenizer
    anchor = anchor_ids("chat", tok)
    ex = make_example(tok, prompt, CHUNKS, reply, anchor, soft, tok.pad_token_id)
    with torch.no_grad():
        ref = student_logits(tiny.model, enc, ex, num_reply=1)
    torch.testing.assert_close(pre.logits, ref[0], atol=1e-4, rtol=0)
    # and the encoding matters: the training-free blobs give other logits
    plain = TurboRAGEngine(tiny, store=str(tmp_path / "kv2"), progress=False, encoder=None,
                           recovery="none")
    plain.encode_chunks(CHUNKS)
    other = plain.prefill(plain.assembly.segments(prompt, CHUNKS)[0], reserve=4).logits
    assert (other - pre.logits).abs().max() > 1e-3
    engine.cache_pool.release(pre.cache)


CONTEXTS = [None, "The registry lists people and their things.\n\nAlice was a painter.",
            "Chapter two: rivers of the east."]


def test_stitched_logits_equal_the_training_forward_with_contexts(tiny, tmp_path):
    """The same invariant for blobs encoded after their document's text (context encoding):
    `make_example(contexts=)` lays each context between the chunk's anchor and soft slots, hidden
    from the prompt, with the LoRA on, as the engine encodes it; the training forward then
    reproduces the stitched prompt's logits, and differs from the layout without contexts."""
    enc = encoding_for(tiny, soft=3, rank=4)
    engine = TurboRAGEngine(tiny, store=str(tmp_path / "kv"), progress=False, encoder=enc,
                            context_tokens=40, recovery="none")
    engine.encode_chunks(CHUNKS, contexts=CONTEXTS)
    prompt = prompt_of(engine)
    pre = engine.prefill(engine.assembly.segments(prompt, CHUNKS)[0], reserve=4)
    tok = tiny.tokenizer
    anchor = anchor_ids("chat", tok)
    ctx = [engine.library.encoder.context_ids(c, len(engine.library.encoder.tokenize(t)), t)
           for c, t in zip(CONTEXTS, CHUNKS)]
    # a document's first chunk has none; one context is cut to the limit, one is shorter
    assert ctx[0] == [] and len(ctx[1]) == 40 and 0 < len(ctx[2]) < 40
    ex = make_example(tok, prompt, CHUNKS, "Paris", anchor, 3, tok.pad_token_id, ctx)
    assert ex.context_len == len(ctx[1]) + len(ctx[2])
    with torch.no_grad():
        ref = student_logits(tiny.model, enc, ex, num_reply=1)
        alone = student_logits(tiny.model, enc, make_example(
            tok, prompt, CHUNKS, "Paris", anchor, 3, tok.pad_token_id), num_reply=1)
    torch.testing.assert_close(pre.logits, ref[0], atol=1e-4, rtol=0)
    assert (alone[0] - pre.logits).abs().max() > 1e-3
    engine.cache_pool.release(pre.cache)


def test_full_prefill_is_the_unmodified_model(tiny_llama, tmp_path):
    """Only blobs change: a full prefill with an encoder answers token for token as without."""
    enc = encoding_for(tiny_llama)
    with_enc = TurboRAGEngine(tiny_llama, store=str(tmp_path / "a"), progress=False, encoder=enc,
                              recovery="none")
    without = TurboRAGEngine(tiny_llama, store=str(tmp_path / "b"), progress=False, encoder=None,
                             recovery="none")
    prompt = prompt_of(with_enc)
    a = with_enc.generate(prompt, mode="naive")
    b = without.generate(prompt, mode="naive")
    assert a.token_ids == b.token_ids
    assert with_enc.fingerprint.model_id == without.fingerprint.model_id  # same weights
    state = {k: v.clone() for k, v in tiny_llama.model.state_dict().items()}
    with_enc.encode_chunks(CHUNKS)
    assert all(torch.equal(state[k], v) for k, v in tiny_llama.model.state_dict().items())


def test_encoder_is_part_of_fingerprint_and_key(tiny_llama, tmp_path):
    kv = str(tmp_path / "kv")
    one = TurboRAGEngine(tiny_llama, store=kv, progress=False, encoder=encoding_for(tiny_llama),
                         recovery="none")
    two = TurboRAGEngine(tiny_llama, store=kv, progress=False,
                         encoder=encoding_for(tiny_llama, seed=2), recovery="none")
    none = TurboRAGEngine(tiny_llama, store=kv, progress=False, encoder=None, recovery="none")
    keys = {e.library.chunk_key(CHUNKS[0]) for e in (one, two, none)}
    assert len(keys) == 3
    assert len({e.fingerprint.id for e in (one, two, none)}) == 3
    one.encode_chunks(CHUNKS)
    assert two.library.blob_for(CHUNKS[0]) is None  # another encoder's blob is never used
    assert one.library.blob_for(CHUNKS[0]) is not None


def test_file_round_trip_and_refusals(tiny_llama, tmp_path):
    enc = encoding_for(tiny_llama)
    path = enc.save(tmp_path / "enc.safetensors")
    back = LearnedEncoding.load(path)
    assert back.digest() == enc.digest()
    engine = TurboRAGEngine(tiny_llama, store=str(tmp_path / "kv"), progress=False,
                            encoder=str(path), recovery="none")
    assert engine.learned.digest() == enc.digest()
    # another model's weights, another tokenizer, another anchor: refused before any blob
    other = tiny_model("llama", seed=5)
    with pytest.raises(EncoderMismatch, match="other model weights"):
        TurboRAGEngine(other, store=str(tmp_path / "kv"), progress=False, encoder=str(path),
                       recovery="none")
    bad_tok = LearnedEncoding(soft=enc.soft, base_weights=enc.base_weights, tokenizer="x" * 32)
    with pytest.raises(EncoderMismatch, match="another tokenizer"):
        TurboRAGEngine(tiny_llama, store=str(tmp_path / "kv"), progress=False, encoder=bad_tok,
                       recovery="none")
    with pytest.raises(EncoderMismatch, match="anchor"):
        TurboRAGEngine(tiny_llama, store=str(tmp_path / "kv"), progress=False, encoder=enc,
                       anchor="bos", recovery="none")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(EncoderMismatch, match="not a readable"):
        LearnedEncoding.load(tmp_path / "junk.safetensors")
    with pytest.raises(EncoderMismatch, match="no encoder file"):
        LearnedEncoding.load(tmp_path / "missing.safetensors")


def test_encoder_lora_acts_only_in_the_thread_that_encodes(tiny_llama):
    """A chunk encoded on one thread must not change a forward another thread runs at the same
    moment on the same model (the hooks stay installed; only the encoding thread activates them)."""
    import threading

    enc = encoding_for(tiny_llama, soft=0, rank=4)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    model = tiny_llama.model
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        inside, outside = threading.Event(), threading.Event()
        seen = {}

        def other_thread():
            inside.wait()
            seen["logits"] = model(input_ids=ids).logits
            outside.set()

        t = threading.Thread(target=other_thread)
        t.start()
        with enc.active(model):
            with_lora = model(input_ids=ids).logits
            inside.set()
            outside.wait(30)
        t.join()
        after = model(input_ids=ids).logits
    assert (with_lora - plain).abs().max() > 1e-3
    torch.testing.assert_close(seen["logits"], plain, atol=0, rtol=0)
    torch.testing.assert_close(after, plain, atol=0, rtol=0)


def test_a_learned_encoder_leaves_fast_and_batched_decoding_on(tiny_llama, tmp_path):
    """The encoder's LoRA hooks stay on the model after the first chunk is encoded, inert
    outside the encoding block. Fast decoding (which reads the weights directly) and the batch
    scheduler built on it must stay on, with the stock forward's greedy tokens; when they saw
    the hooks as an adapter's, every engine with the shipped encoder decoded on the slow stock
    path and the scheduler never batched."""
    import threading

    from turborag_integrations.core.batching import BatchScheduler
    from turborag_integrations.core.decode.fast import FastDecoder, unsupported_reason
    from turborag_integrations.core.settings import GenerationConfig

    engine = TurboRAGEngine(tiny_llama, store=str(tmp_path / "kv"), progress=False,
                            encoder=encoding_for(tiny_llama), recovery="none")
    engine.encode_chunks(CHUNKS)  # installs the hooks
    model = tiny_llama.model
    assert any(m._forward_hooks for m in model.modules())
    assert unsupported_reason(model) is None
    assert FastDecoder.for_model(model, matmul="linear") is not None
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    prompt = prompt_of(engine)
    fast = engine.generate(prompt, chunks=CHUNKS, config=config)
    handle = model.register_forward_hook(lambda *a: None)  # a foreign hook: stock decoding
    try:
        assert unsupported_reason(model) is not None
        stock = engine.generate(prompt, chunks=CHUNKS, config=config)
    finally:
        handle.remove()
    assert fast.token_ids == stock.token_ids
    with BatchScheduler(engine, max_batch=2) as scheduler:
        streams = [scheduler.submit(prompt, chunks=CHUNKS, config=config) for _ in range(2)]
        threads = [threading.Thread(target=lambda s=s: [None for _ in s]) for s in streams]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert scheduler.steps > 0
    assert [s.result.token_ids for s in streams] == [fast.token_ids] * 2


def test_encoder_batches_are_bounded_by_tokens_as_well_as_by_chunks(monkeypatch):
    """Memory follows the tokens a forward reads: batches of at most `most` chunks and
    BATCH_TOKENS tokens, in order, a chunk longer than the bound alone in its batch."""
    from turborag_integrations.core.prefill import chunk_encoder

    monkeypatch.setattr(chunk_encoder, "BATCH_TOKENS", 100)
    batches = chunk_encoder.token_batches(list(range(7)), [30, 30, 30, 30, 150, 10, 10], 3)
    assert batches == [[0, 1, 2], [3], [4], [5, 6]]
    assert chunk_encoder.token_batches([], [], 8) == []
    assert chunk_encoder.token_batches([1, 2, 3], [1, 1, 1], 2) == [[1, 2], [3]]
