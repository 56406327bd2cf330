"""Invariant 6, token-exact: a stitched prompt is the prompt's own tokenization, cut into plain
runs and chunk runs; nothing lost, repeated or re-tokenized."""

import pytest
import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.prefill.rope import KeyRotator
from turborag_integrations.core.prefill.segment import token_pieces, tokenize_with_starts
from turborag_integrations.core.prefill.stitch import plan_prompt, prefill, reference_forward
from turborag_integrations.core.settings import GenerationConfig
from tests.conftest import byte_tokenizer, tiny_model

# "\n\n" alone is one token with this merge; between a sentence and a word the byte-level
# pre-tokenizer splits it in two, as SmolLM2's tokenizer does
NEWLINES = (("Ċ", "Ċ"),)
CHUNKS = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles."]


def own(tok):
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


def test_separators_keep_the_whole_prompts_tokens():
    tok = byte_tokenizer(NEWLINES)
    prompt = "Context:\n" + "\n\n".join(CHUNKS) + "\n\nQuestion: who?"
    ids, starts = tokenize_with_starts(tok, prompt)
    # the premise: piece by piece, "\n\n" would be one token instead of the prompt's two
    assert len(own(tok)("\n\n")) == 1
    assert ids.count(own(tok)("\n")[0]) >= 2
    pieces = token_pieces(prompt, ids, starts, CHUNKS, own(tok))
    assert [t for p in pieces for t in p.ids] == ids
    assert "".join(p.text for p in pieces) == prompt
    assert [p.chunk for p in pieces if p.chunk] == CHUNKS
    assert all(list(p.ids) == own(tok)(p.chunk) for p in pieces if p.chunk)


def test_a_chunk_whose_tail_merges_keeps_its_leading_tokens():
    tok = byte_tokenizer(NEWLINES)
    chunk = "Alice was born in Paris.\n"
    prompt = "Context:\n" + chunk + "\n Question: where?"  # "\n\n " : the chunk's "\n" merges
    ids, starts = tokenize_with_starts(tok, prompt)
    pieces = token_pieces(prompt, ids, starts, [chunk], own(tok))
    [used] = [p for p in pieces if p.chunk]
    assert list(used.ids) == own(tok)(chunk)[:-1]
    assert [t for p in pieces for t in p.ids] == ids


def test_a_chunk_inside_a_token_of_the_text_before_it_is_not_used():
    tok = byte_tokenizer((("Ġ", "A"),))  # " A" is one token: a chunk "Alice…" after a space
    prompt = "Context: " + CHUNKS[0] + "\nQ?"
    ids, starts = tokenize_with_starts(tok, prompt)
    pieces = token_pieces(prompt, ids, starts, [CHUNKS[0]], own(tok))
    assert not any(p.chunk for p in pieces)
    assert [t for p in pieces for t in p.ids] == ids


def test_engine_stitches_the_prompts_own_tokens_and_is_exact(tmp_path):
    """The engine's stitched prompt (separators between chunks, a chunk cut short by a merge)
    holds exactly the tokens of a full prefill, and its logits are the independent-attention
    forward's (invariant 2)."""
    loaded = tiny_model("llama", merges=NEWLINES)
    engine = TurboRAGEngine(loaded, store=tmp_path / "kv", anchor="none", encoder=None)
    chunks = CHUNKS + ["The river Xan flows north.\n"]
    engine.encode_chunks(chunks)
    prompt = "Context:\n" + "\n\n".join(chunks) + "\n Question: who keeps bicycles?\nAnswer:"
    segments, hits, misses = engine.assembly.segments(prompt, chunks)
    assert (hits, misses) == (3, 0)
    plan = plan_prompt(segments, engine.tokenizer, fingerprint=engine.fingerprint)
    assert plan.token_ids == engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    # the head is cached plain, each "\n\n" between chunks (two tokens here) from its blob;
    # one chunk's tail merged with the text after it
    assert plan.reused_tokens == sum(len(own(engine.tokenizer)(c)) for c in chunks) - 1 + \
        len(own(engine.tokenizer)("Context:\n")) + 2 * 2
    stitched = prefill(loaded.model, plan, KeyRotator.for_model(loaded.model), all_logits=True)
    reference = reference_forward(loaded.model, plan)[plan.plain_index]
    torch.testing.assert_close(stitched.logits, reference, atol=1e-4, rtol=0)
    result = engine.generate(prompt, chunks=chunks, config=GenerationConfig(max_new_tokens=4))
    assert result.stats.prompt_tokens == len(plan.token_ids)


def test_a_slow_tokenizer_falls_back_to_pieces_tokenized_alone(tmp_path, monkeypatch):
    import turborag_integrations.core.assembly as engine_module

    monkeypatch.setattr(engine_module, "tokenize_with_starts", lambda tokenizer, prompt: None)
    engine = TurboRAGEngine(tiny_model("llama", merges=NEWLINES), store=tmp_path / "kv",
                            anchor="none", encoder=None)
    engine.encode_chunks(CHUNKS)
    prompt = "\n\n".join(CHUNKS) + "\n\nQ?"
    segments, hits, _ = engine.assembly.segments(prompt, CHUNKS)
    assert hits == 2 and "".join(s.text for s in segments) == prompt
    plan = plan_prompt(segments, engine.tokenizer)
    # the "\n\n" between the chunks tokenized alone: one token fewer than in the whole prompt
    assert len(plan.token_ids) == len(own(engine.tokenizer)(prompt)) - 1


@pytest.mark.parametrize("n", [0, 99])
def test_a_blob_head_must_be_within_the_blob(tmp_path, n):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", encoder=None)
    blob = engine.library.encoder.encode(CHUNKS[0])
    assert blob.head(3).num_tokens == 3 and blob.head(3).base_position == blob.base_position
    with pytest.raises(ValueError, match="no head"):
        blob.head(n + blob.num_tokens if n else 0)


def test_a_stock_separator_between_chunks_is_stitched_from_its_blob(tmp_path):
    """Between two chunks, "\n\n" (in the whole prompt's tokens) comes from its stored blob, as
    vLLM's connector must take it; elsewhere, and around other glue, text is prefilled."""
    loaded = tiny_model("llama", merges=NEWLINES)
    engine = TurboRAGEngine(loaded, store=tmp_path / "kv", anchor="none", encoder=None)
    engine.encode_chunks(CHUNKS)
    prompt = "Context:\n" + "\n\n".join(CHUNKS) + "\n\nQuestion: who?"
    segments, hits, _ = engine.assembly.segments(prompt, CHUNKS)
    cached = [s.text for s in segments if s.cached]
    assert hits == 2 and cached == ["Context:\n", CHUNKS[0], "\n\n", CHUNKS[1]]
    plan = plan_prompt(segments, engine.tokenizer, fingerprint=engine.fingerprint)
    assert plan.token_ids == own(engine.tokenizer)(prompt)
    stitched = prefill(loaded.model, plan, KeyRotator.for_model(loaded.model), all_logits=True)
    reference = reference_forward(loaded.model, plan)[plan.plain_index]
    torch.testing.assert_close(stitched.logits, reference, atol=1e-4, rtol=0)
    other = "Context:\n" + CHUNKS[0] + "\n--\n" + CHUNKS[1] + "\nQ?"
    assert [s.text for s in engine.assembly.segments(other, CHUNKS)[0] if s.cached] == [
        "Context:\n", CHUNKS[0], CHUNKS[1]]


def test_separators_can_be_prefilled_instead(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama", merges=NEWLINES), store=tmp_path / "kv",
                            anchor="none", encoder=None, separators=False)
    engine.encode_chunks(CHUNKS)
    prompt = "Context:\n" + "\n\n".join(CHUNKS) + "\n\nQuestion: who?"
    segments, _, _ = engine.assembly.segments(prompt, CHUNKS)
    assert [s.text for s in segments if s.cached] == ["Context:\n", *CHUNKS]
    assert engine.namespaced("a").config.query.separators is False
