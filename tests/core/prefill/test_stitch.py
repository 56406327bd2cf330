"""Invariants 2 and 6: stitched prefill equals one forward under the independent-attention mask;
segmentation never loses, duplicates or reorders text."""

import pytest
import torch

from turborag_integrations.core.prefill.chunk_encoder import ChunkEncoder
from turborag_integrations.core.kv.blob import fingerprint_model
from turborag_integrations.core.errors import ContextWindowError, FingerprintMismatch
from turborag_integrations.core.prefill.rope import KeyRotator
from turborag_integrations.core.prefill.segment import split_prompt
from turborag_integrations.core.prefill.stitch import (Segment, independent_attention_mask, plan_prompt,
                                               prefill, reference_forward)
from tests.conftest import tiny_model

CHUNKS = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles.",
          "The river Xan flows north to the sea."]


ANCHOR = "<s>system\nYou are a helpful assistant.</s>\n<s>user\n"


def build(loaded, layout, anchor: str = ""):
    fp = fingerprint_model(loaded.model, loaded.tokenizer, loaded.name)
    ids = loaded.tokenizer(anchor, add_special_tokens=False)["input_ids"] if anchor else []
    enc = ChunkEncoder(loaded.model, loaded.tokenizer, fp, batch_size=2, anchor_ids=ids)
    blobs = enc.encode_many(CHUNKS)
    segs = [Segment(CHUNKS[x], blobs[x]) if isinstance(x, int) else Segment(x) for x in layout]
    return fp, segs


LAYOUTS = {
    "chunks_then_question": [0, 1, 2, "\nQ: where was Alice born?\nA:"],
    "prefix_glue_chunks": ["<s>system\nUse the context.</s>\n", 0, "\n\n", 1, "\n---\n", 2,
                           "\nQuestion: who keeps bicycles?\nAnswer:"],
    "plain_first_and_between": ["Context:", 2, " and ", 0, "?"],
}


def assert_logits_equal_masked_forward(loaded, layout: str, anchor: str):
    """Stitch LAYOUTS[layout] and check its logits against one forward over the whole prompt
    under the independent-attention mask; returns the plan."""
    fp, segs = build(loaded, LAYOUTS[layout], anchor)
    plan = plan_prompt(segs, loaded.tokenizer, fingerprint=fp)
    stitched = prefill(loaded.model, plan, KeyRotator.for_model(loaded.model), all_logits=True)
    anchor_ids = loaded.tokenizer(anchor, add_special_tokens=False)["input_ids"] if anchor else []
    reference = reference_forward(loaded.model, plan, anchor_ids)[plan.plain_index]
    torch.testing.assert_close(stitched.logits, reference, atol=1e-4, rtol=0)
    return plan


@pytest.mark.parametrize("anchor", ["", ANCHOR, "<s>"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stitched_logits_equal_independent_attention_forward(tiny, layout, anchor):
    """Invariant 2, for every chunk encoding: each chunk sees only itself (and the anchor it was
    encoded after, which nothing else sees); every other token sees all before it."""
    plan = assert_logits_equal_masked_forward(tiny, layout, anchor)
    used = [CHUNKS[x] for x in LAYOUTS[layout] if isinstance(x, int)]
    assert plan.reused_tokens == sum(len(tiny.tokenizer(c, add_special_tokens=False)["input_ids"])
                                     for c in used)


def assert_cache_equals_masked_forward(loaded, plan, stitched) -> None:
    """Every key and value of a stitched cache equals the one a full forward under the
    independent-attention mask computes at the same position (chunks first, then plain tokens,
    the stitched cache's order)."""
    n = len(plan.token_ids)
    spans = [(s.prompt_start, s.blob.num_tokens) for s in plan.spans]
    mask = independent_attention_mask(n, spans)
    additive = torch.zeros(n, n).masked_fill_(~mask, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        out = loaded.model(input_ids=torch.tensor([plan.token_ids]),
                           position_ids=torch.tensor([plan.positions]),
                           attention_mask=additive[None, None], use_cache=True)
    order = [i for s, l in spans for i in range(s, s + l)] + plan.plain_index
    for got, want in zip(stitched.cache.layers, out.cache.layers):
        torch.testing.assert_close(got.keys[0], want.keys[0][:, order], atol=1e-4, rtol=0)
        torch.testing.assert_close(got.values[0], want.values[0][:, order], atol=1e-4, rtol=0)


def test_stitched_cache_equals_reference_cache(tiny_llama):
    """The stitched cache holds exactly the KV of a forward under the mask (chunks, then plain)."""
    fp, segs = build(tiny_llama, LAYOUTS["prefix_glue_chunks"])
    plan = plan_prompt(segs, tiny_llama.tokenizer, fingerprint=fp)
    stitched = prefill(tiny_llama.model, plan, KeyRotator.for_model(tiny_llama.model))
    assert_cache_equals_masked_forward(tiny_llama, plan, stitched)


def test_chunk_right_after_its_anchor_equals_a_full_prefill(tiny):
    """A prompt whose head is the anchor text, followed by one chunk: the chunk's cached KV is
    exactly what a full forward computes there, so the logits equal an ordinary causal forward."""
    fp, segs = build(tiny, [ANCHOR, 0, "\nQ: where was Alice born?\nA:"], ANCHOR)
    plan = plan_prompt(segs, tiny.tokenizer, fingerprint=fp)
    assert plan.spans[0].blob.base_position == plan.spans[0].prompt_start  # rotated by 0
    stitched = prefill(tiny.model, plan, KeyRotator.for_model(tiny.model), all_logits=True)
    with torch.inference_mode():
        full = tiny.model(input_ids=torch.tensor([plan.token_ids])).logits[0].float()
    torch.testing.assert_close(stitched.logits, full[plan.plain_index], atol=1e-4, rtol=0)


def test_anchor_is_part_of_key_and_fingerprint(tiny_llama):
    """Blobs made after different anchors (or none) never share a key or a fingerprint id, but
    they come from one model setup, so a prompt may mix them (plain prefix + anchored chunks)."""
    fp = fingerprint_model(tiny_llama.model, tiny_llama.tokenizer, tiny_llama.name)
    tok = tiny_llama.tokenizer
    blobs = [ChunkEncoder(tiny_llama.model, tok, fp, anchor_ids=tok(a, add_special_tokens=False)
                          ["input_ids"] if a else []).encode(CHUNKS[0])
             for a in ("", "<s>", ANCHOR)]
    assert len({b.key for b in blobs}) == 3
    assert len({b.fingerprint.id for b in blobs}) == 3
    assert len({b.fingerprint.model_id for b in blobs}) == 1
    assert [b.base_position for b in blobs] == [0, 1, len(tok(ANCHOR, add_special_tokens=False)
                                                           ["input_ids"])]
    blobs[0].fingerprint.check_matches(blobs[2].fingerprint)  # same model: no error


def test_merged_fine_tune_gets_another_fingerprint(tiny_llama):
    """A change confined to one projection (as a merged LoRA is) changes the fingerprint."""
    fp = fingerprint_model(tiny_llama.model, tiny_llama.tokenizer, "m")
    with torch.no_grad():
        tiny_llama.model.model.layers[0].self_attn.q_proj.weight[0, 0] += 1e-3
    tuned = fingerprint_model(tiny_llama.model, tiny_llama.tokenizer, "m")
    assert tuned.weights != fp.weights
    with pytest.raises(FingerprintMismatch, match="weights"):
        fp.check_matches(tuned)


def test_independent_attention_mask_shape():
    m = independent_attention_mask(7, [(1, 2), (3, 3)])
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [0, 1, 0, 0, 0, 0, 0],  # chunk A sees only itself
        [0, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 1, 0, 0, 0],  # chunk B sees only itself
        [0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 1, 1],  # the question sees everything
    ], dtype=torch.bool)
    assert torch.equal(m, expected)


def test_every_token_sits_at_its_index_in_the_prompt(tiny_llama):
    fp, segs = build(tiny_llama, ["ab", 0, "c", 1, "de"])
    n0, n1 = segs[1].blob.num_tokens, segs[3].blob.num_tokens
    plan = plan_prompt(segs, tiny_llama.tokenizer)
    assert plan.positions == list(range(2 + n0 + 1 + n1 + 2))
    # each chunk's blob is moved to where it stands: its first token's prompt index
    assert [(s.prompt_start, s.position_start) for s in plan.spans] == [(2, 2), (3 + n0, 3 + n0)]


@pytest.mark.parametrize("prompt, chunks", [
    ("Context:\nA\n\nB\nQ?", ["A", "B"]),
    ("xx A A yy", ["A"]),
    ("nothing here", ["zzz"]),
    ("AB overlap", ["AB", "B overlap"]),
    ("", ["A"]),
    ("the chunk is the whole prompt", ["the chunk is the whole prompt"]),
])
def test_split_prompt_concatenates_back(prompt, chunks):
    pieces = split_prompt(prompt, chunks)
    assert "".join(t for t, _ in pieces) == prompt
    assert all(t in chunks for t, is_chunk in pieces if is_chunk)


def test_stitched_tokens_are_concatenated_segment_tokens(tiny_llama):
    fp, segs = build(tiny_llama, LAYOUTS["prefix_glue_chunks"])
    plan = plan_prompt(segs, tiny_llama.tokenizer, fingerprint=fp)
    expected = []
    for s in segs:
        expected += tiny_llama.tokenizer(s.text, add_special_tokens=False)["input_ids"]
    assert plan.token_ids == expected


def test_blob_of_another_model_is_refused_naming_both(tiny_llama):
    other = tiny_model("llama", seed=1)  # same config, other weights
    fp_other, segs = build(other, [0, "Q?"])
    fp = fingerprint_model(tiny_llama.model, tiny_llama.tokenizer, tiny_llama.name)
    with pytest.raises(FingerprintMismatch, match="weights") as err:
        plan_prompt(segs, tiny_llama.tokenizer, fingerprint=fp)
    assert "tiny-llama-1" in str(err.value) and "tiny-llama-0" in str(err.value)


def test_dtype_is_part_of_the_fingerprint(tiny_llama):
    fp32 = fingerprint_model(tiny_llama.model, tiny_llama.tokenizer, "m")
    bf16 = fingerprint_model(tiny_llama.model.to(torch.bfloat16), tiny_llama.tokenizer, "m")
    with pytest.raises(FingerprintMismatch, match="dtype"):
        fp32.check_matches(bf16)


def test_prompt_longer_than_window_fails_before_compute(tiny_llama):
    fp, segs = build(tiny_llama, [0, "x" * 2100])
    with pytest.raises(ContextWindowError, match="context window of 2048"):
        plan_prompt(segs, tiny_llama.tokenizer, fingerprint=fp, context_window=2048)


def test_trailing_chunk_is_prefilled(tiny_llama):
    fp, segs = build(tiny_llama, ["Q: ", 0])
    plan = plan_prompt(segs, tiny_llama.tokenizer, fingerprint=fp)
    assert plan.reused_tokens == 0 and plan.prefilled_tokens == len(plan.token_ids)


def test_cache_grown_during_a_forward_can_be_reused(tiny_llama):
    """Storage that grew under inference mode must stay writable when the pool hands it out."""
    from turborag_integrations.core.kv.cache import CachePool

    pool = CachePool()
    cache = pool.acquire(tiny_llama.model, capacity=4)
    with torch.inference_mode():
        tiny_llama.model(input_ids=torch.tensor([[5, 6, 7, 8, 9, 10]]), cache=cache, use_cache=True)
    assert cache.length == 6
    pool.release(cache)
    again = pool.acquire(tiny_llama.model, capacity=6)
    k, v = again.slot(3)
    k.zero_()  # outside inference mode: must not raise
    assert again.length == 3
