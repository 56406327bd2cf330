"""Training-free recovery: recomputed chunk tokens see the whole context; the rest stay cached."""

import re

import pytest
import torch

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.core.prefill.recovery import (BoundaryRecompute, Combined,
                                                         FirstChunkRecompute, NO_RECOVERY,
                                                         SelectiveRecompute,
                                                         parse_recovery, recompute_tokens,
                                                         value_deviation)
from turborag_integrations.core.prefill.rope import KeyRotator
from turborag_integrations.core.prefill.stitch import plan_prompt, prefill
from tests.core.prefill.test_stitch import LAYOUTS, build


def full_causal_logits(model, plan):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([plan.token_ids]),
                    position_ids=torch.tensor([plan.positions]), use_cache=False)
    return out.logits[0].float()


def stitched(loaded, layout="prefix_glue_chunks", recovery=None):
    fp, segs = build(loaded, LAYOUTS[layout] if isinstance(layout, str) else layout)
    plan = plan_prompt(segs, loaded.tokenizer, fingerprint=fp)
    pre = prefill(loaded.model, plan, KeyRotator.for_model(loaded.model), all_logits=True,
                  recovery=recovery)
    return plan, pre


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_recomputing_every_chunk_token_equals_full_prefill(tiny, layout):
    plan, pre = stitched(tiny, layout, recovery=BoundaryRecompute(10_000))
    assert pre.plan.reused_tokens == sum(s.blob.num_tokens for s in plan.spans
                                         if s.prompt_start == 0)  # only the exact prefix is kept
    full = full_causal_logits(tiny.model, plan)[pre.plan.plain_index]
    torch.testing.assert_close(pre.logits, full, atol=1e-4, rtol=0)


def test_selective_ratio_one_equals_full_prefill(tiny_llama):
    plan, pre = stitched(tiny_llama, recovery=SelectiveRecompute(1.0))
    full = full_causal_logits(tiny_llama.model, plan)[pre.plan.plain_index]
    torch.testing.assert_close(pre.logits, full, atol=1e-4, rtol=0)


def test_recovery_zero_is_plain_turbo(tiny_llama):
    _, base = stitched(tiny_llama)
    for rec in (BoundaryRecompute(0), SelectiveRecompute(0.0), parse_recovery("none")):
        _, pre = stitched(tiny_llama, recovery=rec)
        torch.testing.assert_close(pre.logits, base.logits, atol=0, rtol=0)


def test_holes_keep_every_other_token_at_its_place(tiny_llama):
    """Recomputing a scattered set of tokens equals recomputing them one by one in plain form:
    checked by recomputing *all but* a kept set in two different splits, which must agree."""
    plan, _ = stitched(tiny_llama)
    cached = [i for s in plan.spans if s.prompt_start > 0
              for i in range(s.prompt_start, s.prompt_start + s.blob.num_tokens)]
    holes = cached[1::3]
    new = recompute_tokens(plan, holes)
    assert new.token_ids == plan.token_ids and new.positions == plan.positions
    assert new.reused_tokens == plan.reused_tokens - len(holes)
    assert sorted(new.plain_index) == sorted(plan.plain_index + holes)
    # every kept token's (prompt index, id) survives in a span, in order
    kept = [(s.prompt_start + j, int(s.blob.token_ids[j])) for s in new.spans
            for j in range(s.blob.num_tokens)]
    assert kept == sorted((i, plan.token_ids[i]) for i in set(range(len(plan.token_ids)))
                          - set(new.plain_index))
    rot = KeyRotator.for_model(tiny_llama.model)
    pre = prefill(tiny_llama.model, new, rot, all_logits=True)
    # Keys of a kept run sit at their original positions: the cache of run tokens equals the
    # cache of the stitched prompt without recovery.
    base = prefill(tiny_llama.model, plan, rot)
    span = next(s for s in new.spans if s.prompt_start > 0)
    orig = next(s for s in plan.spans if s.prompt_start <= span.prompt_start
                < s.prompt_start + s.blob.num_tokens)
    def cache_rows(p, spans, target):
        offset = 0
        for s in spans:
            if s is target:
                return offset
            offset += s.blob.num_tokens
    a = cache_rows(new, new.spans, span)
    b = cache_rows(plan, plan.spans, orig) + (span.prompt_start - orig.prompt_start)
    n = span.blob.num_tokens
    torch.testing.assert_close(pre.cache.layers[0].keys[:, :, a:a + n],
                               base.cache.layers[0].keys[:, :, b:b + n], atol=1e-5, rtol=0)
    assert torch.isfinite(pre.logits).all()


def test_value_deviation_zero_where_attention_is_unchanged(tiny_llama):
    plan, _ = stitched(tiny_llama)
    dev = value_deviation(tiny_llama.model, plan, layer=1)
    assert dev[plan.plain_index].abs().max() == 0  # plain tokens have no cached values
    first = plan.spans[0]
    assert dev[first.prompt_start:first.prompt_start + first.blob.num_tokens].max() > 1e-3
    rec = SelectiveRecompute(0.25)
    chosen = rec.select(tiny_llama.model, plan, None)
    cached = {i for s in plan.spans for i in range(s.prompt_start, s.prompt_start + s.blob.num_tokens)}
    assert len(chosen) == -(-len(cached) // 4) and set(chosen) <= cached


def test_first_recomputes_the_first_chunk_and_nothing_else(tiny_llama):
    plan, pre = stitched(tiny_llama, recovery=FirstChunkRecompute())
    first, *rest = plan.spans  # the prefix is plain text here, prefilled
    assert first.prompt_start > 0 and rest
    recomputed = set(range(first.prompt_start, first.prompt_start + first.blob.num_tokens))
    assert recomputed <= set(pre.plan.plain_index)
    assert pre.plan.reused_tokens == plan.reused_tokens - first.blob.num_tokens
    assert [s.prompt_start for s in pre.plan.spans] == [s.prompt_start for s in rest]
    _, part = stitched(tiny_llama, recovery=FirstChunkRecompute(3))
    assert set(part.plan.plain_index) - set(plan.plain_index) == set(
        range(first.prompt_start, first.prompt_start + 3))


def test_first_over_a_prompt_of_one_chunk_is_the_full_prefill(tiny_llama):
    """The first chunk follows only the exact cached prefix: recomputed, it is the full
    prefill's, where its blob, encoded alone, is not."""
    layout = ["<s>system\nUse the context.</s>\n", 0, "\nQ: where was Alice born?\nA:"]
    plan, pre = stitched(tiny_llama, layout, recovery=FirstChunkRecompute())
    full = full_causal_logits(tiny_llama.model, plan)[pre.plan.plain_index]
    torch.testing.assert_close(pre.logits, full, atol=1e-4, rtol=0)
    _, plain = stitched(tiny_llama, layout)
    assert (plain.logits[-1] - full[-1]).abs().max() > 1e-3


def test_parse_recovery():
    assert parse_recovery(None) is None  # not given: the engine's default
    assert parse_recovery("none") is NO_RECOVERY and str(NO_RECOVERY) == "none"
    assert parse_recovery("first") == FirstChunkRecompute()
    assert parse_recovery("first:8") == FirstChunkRecompute(8)
    assert str(parse_recovery("first,boundary:8")) == "first,boundary:8"
    assert parse_recovery("boundary:8") == BoundaryRecompute(8)
    assert parse_recovery("blend:0.1@2") == SelectiveRecompute(0.1, 2)
    both = parse_recovery("boundary:4,blend:0.05")
    assert isinstance(both, Combined) and str(both) == "boundary:4,blend:0.05"
    for bad in ("foo", "boundary:x", "blend:2", "first:x", "first:-1"):
        with pytest.raises(ValueError):
            parse_recovery(bad)


def test_engine_passes_recovery_through(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv")
    chunks = ["Alice was born in Paris in 1901.", "Bob keeps three red bicycles."]
    prompt = "Use the context.\n" + "\n".join(chunks) + "\nQ: who keeps bicycles?\nA:"
    engine.encode_chunks(chunks)
    cfg = GenerationConfig(max_new_tokens=4)
    plain = engine.generate(prompt, chunks=chunks, config=cfg, recovery="none")
    assert plain.stats.extra["recovery"] == "none" and plain.stats.extra["recomputed_tokens"] == 0
    rec = engine.generate(prompt, chunks=chunks, config=cfg, recovery="boundary:5")
    # five tokens of each chunk, and the one-token "\n" stitched between them
    assert rec.stats.reused_tokens == plain.stats.reused_tokens - 5 - 5 - 1
    assert rec.stats.extra["recovery"] == "boundary:5"
    full = engine.generate(prompt, chunks=chunks, config=cfg, recovery="boundary:1000")
    naive = engine.generate(prompt, chunks=chunks, config=cfg, mode="naive")
    assert full.token_ids == naive.token_ids


# ---- query-aware recompute (select:) -------------------------------------------------------
def eager_copy(loaded):
    """The same weights under transformers' eager attention, which returns its probabilities."""
    from tests.conftest import tiny_model

    twin = tiny_model("llama", attn="eager")
    twin.model.load_state_dict(loaded.model.state_dict())
    return twin


def test_question_attention_equals_the_masked_forwards_attention(tiny_llama):
    """The probe's score of each prompt token is the attention the tail (the plain tokens after
    the last chunk) pays it in one forward under TurboRAG's mask, averaged over layers, heads
    and tail tokens: read here from eager attention's own probabilities."""
    from turborag_integrations.core.prefill.relevance import question_attention, tail_length
    from turborag_integrations.core.prefill.stitch import layout

    plan, _ = stitched(tiny_llama)
    rel = question_attention(tiny_llama.model, plan, KeyRotator.for_model(tiny_llama.model))
    tail = tail_length(plan)
    assert tail == len(tiny_llama.tokenizer("\nQuestion: who keeps bicycles?\nAnswer:",
                                            add_special_tokens=False)["input_ids"])
    twin = eager_copy(tiny_llama)
    lay = layout(plan)
    additive = torch.zeros(len(lay.token_ids), len(lay.token_ids)).masked_fill_(
        ~lay.mask(), torch.finfo(torch.float32).min)
    with torch.inference_mode():
        out = twin.model(input_ids=torch.tensor([lay.token_ids]),
                         position_ids=torch.tensor([lay.positions]),
                         attention_mask=additive[None, None], output_attentions=True)
    probs = torch.stack(out.attentions)[:, 0, :, -tail:, :]  # [layers, heads, tail, prompt]
    expected = probs.mean(dim=(0, 1, 2))[lay.prompt_index]
    torch.testing.assert_close(rel.scores, expected, atol=1e-5, rtol=0)
    assert rel.scores.sum() == pytest.approx(1.0, abs=1e-4)


def test_select_recomputes_the_top_scored_chunk_tokens(tiny_llama):
    from turborag_integrations.core.prefill.recovery import QueryAwareRecompute
    from turborag_integrations.core.prefill.relevance import question_attention

    plan, pre = stitched(tiny_llama, recovery=QueryAwareRecompute(0.2))
    chunk = [i for s in plan.spans if s.prompt_start > 0
             for i in range(s.prompt_start, s.prompt_start + s.blob.num_tokens)]
    chosen = set(pre.plan.plain_index) - set(plan.plain_index)
    assert len(chosen) == -(-len(chunk) * 2 // 10)
    scores = question_attention(tiny_llama.model, plan, KeyRotator.for_model(tiny_llama.model)
                                ).scores
    lowest_chosen = min(scores[i] for i in chosen)
    assert all(scores[i] <= lowest_chosen for i in set(chunk) - chosen)
    assert pre.timings["recomputed_tokens"] == len(chosen)


def test_select_everything_equals_full_prefill(tiny):
    """Invariant 11 through select: every chunk token recomputed gives the full prefill's
    logits (and no probe runs)."""
    from turborag_integrations.core.prefill.recovery import QueryAwareRecompute

    plan, pre = stitched(tiny, recovery=QueryAwareRecompute(1.0))
    full = full_causal_logits(tiny.model, plan)[pre.plan.plain_index]
    torch.testing.assert_close(pre.logits, full, atol=1e-4, rtol=0)


def test_select_auto_budget_follows_the_attention_mass():
    from turborag_integrations.core.prefill.recovery import QueryAwareRecompute

    auto = QueryAwareRecompute(None, low=0.05, high=0.5, mass=0.5)
    peaked = torch.tensor([0.5, 0.3] + [0.2 / 98] * 98)  # half the mass on one token
    assert auto.budget(peaked) == 5  # one would do; the floor is 5 of 100
    flat = torch.full((100,), 0.01)
    assert auto.budget(flat) == 50  # half of a flat mass is half of the tokens: the cap
    spread = torch.tensor([0.04] * 10 + [0.006] * 100)  # 40% on ten tokens
    assert auto.budget(spread) == 27  # the ten, then 17 of the rest for the other 10%
    assert QueryAwareRecompute(0.15).budget(flat) == 15


def test_select_specs_and_their_errors():
    from turborag_integrations.core.prefill.recovery import QueryAwareRecompute

    assert parse_recovery("select:0.15") == QueryAwareRecompute(0.15)
    assert str(parse_recovery("select:0.15")) == "select:0.15"
    assert parse_recovery("select:auto") == QueryAwareRecompute(None)
    assert str(parse_recovery("select:auto")) == "select:auto"
    auto = parse_recovery("select:auto:0.1-0.4")
    assert (auto.low, auto.high) == (0.1, 0.4) and str(auto) == "select:auto:0.1-0.4"
    assert str(parse_recovery("boundary:4,select:0.1")) == "boundary:4,select:0.1"
    for bad, says in (("select:0", "(0, 1]"), ("select:1.5", "(0, 1]"), ("select:", "ratio"),
                      ("select:x", "select:RATIO"), ("select:auto:0.3-0.1", "below its floor"),
                      ("select:auto0.1", "auto:LOW-HIGH"), ("select:auto:0.1", "auto:LOW-HIGH")):
        with pytest.raises(ValueError, match=re.escape(says)):
            parse_recovery(bad)
