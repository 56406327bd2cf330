"""RAPID on tiny random models: losslessness at η = 0 (greedy and sampled), cache rollback
(invariant 5), the augmented distribution against the reference code's law, the prefix cache, and
bad input."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from turborag_integrations.core.kv.cache import KVCache
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.errors import ContextWindowError
from turborag_integrations.core.settings import GenerationConfig, SpeculationConfig
from turborag_integrations.core.models import LoadedModel
from turborag_integrations.core.decode.sampling import (Verdict, accept_drafts, augmented_probs,
                                                        residual_probs)
from turborag_integrations.core.rapid import (RapidEngine, Side, VocabularyMismatch, speculate,
                                              target_greedy)
from turborag_integrations.core.attention import split_attention, suffix_causal
from tests.conftest import byte_tokenizer, tiny_model

PARAGRAPHS = [
    "The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora.",
    "The ferry stops running every January, when the harbour freezes over.",
    "The Orbital Kiln Company fires ceramic tiles in a vacuum furnace.",
    "Mirrored sunlight heats the furnace to 1600 degrees at noon.",
    "Glacier expeditions leave from the northern camp at dawn each spring.",
]
CONTEXT = "\n\n".join(PARAGRAPHS)
QUESTION = "How high is the lighthouse?"


@pytest.fixture
def target(tiny, tmp_path):
    return TurboRAGEngine(tiny, store=tmp_path / "kv", progress=False)


@pytest.fixture
def pair(tmp_path):
    """Target and a different drafter (another seed) on one byte vocabulary."""
    t = TurboRAGEngine(tiny_model("llama", seed=0), store=tmp_path / "kv", progress=False)
    d = TurboRAGEngine(tiny_model("llama", seed=1), store=tmp_path / "kv", progress=False)
    return t, d


def reference(rapid: RapidEngine, n: int) -> list[int]:
    prefix, suffix = rapid.render(rapid.target, CONTEXT, QUESTION)
    return target_greedy(rapid.target, prefix, suffix, n)


# ---- invariant 4: lossless at η = 0 ------------------------------------------------------------

@pytest.mark.parametrize("gamma", [1, 4, 10])
def test_greedy_eta0_equals_target_greedy_other_drafter(pair, gamma):
    t, d = pair
    rapid = RapidEngine(t, d, gamma=gamma, policy="always")
    out = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1],
                         config=GenerationConfig(max_new_tokens=40))
    assert out.token_ids == reference(rapid, 40)[:len(out.token_ids)]
    assert len(out.token_ids) == len(reference(rapid, 40))
    assert out.stats.drafted > 0


def test_greedy_eta0_self_speculation(target):
    rapid = RapidEngine(target, gamma=6, policy="always")
    out = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:2],
                         config=GenerationConfig(max_new_tokens=48))
    assert out.token_ids == reference(rapid, 48)
    s = out.stats
    assert s.accepted > 0 and 0 < s.acceptance_rate <= 1
    assert s.drafter_reused_tokens > 0  # chunks came from blobs
    assert s.target_prefill_s > 0 and s.drafter_prefill_s > 0 and s.ttft_s > 0
    assert s.mean_accepted == s.accepted / s.rounds


def test_empty_retrieval_drafts_from_question_alone(target):
    rapid = RapidEngine(target, gamma=4, policy="always")
    out = rapid.generate(CONTEXT, QUESTION, chunks=[], config=GenerationConfig(max_new_tokens=32))
    assert out.stats.drafter_chunks == 0
    assert out.stats.drafter_reused_tokens == 0
    assert out.token_ids == reference(rapid, 32)


def test_own_retrieval_below_threshold_is_empty_and_still_lossless(target):
    rapid = RapidEngine(target, gamma=4, threshold=1.01, policy="always")  # cosine never reaches it
    out = rapid.generate(CONTEXT, QUESTION, config=GenerationConfig(max_new_tokens=16))
    assert out.stats.drafter_chunks == 0
    assert out.token_ids == reference(rapid, 16)


def test_own_retrieval_budget_and_document_order(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", progress=False)
    rapid = RapidEngine(engine, chunk_tokens=80, threshold=0.0, compression=2.5, policy="always")
    ctx = rapid.drafter_context(CONTEXT, "lighthouse cliffs Velmora furnace")
    assert ctx.candidates > 1
    assert 0 < ctx.tokens <= ctx.budget <= sum(len(p.encode()) for p in PARAGRAPHS) / 2.5 + 8
    positions = [CONTEXT.index(c) for c in ctx.chunks]
    assert positions == sorted(positions)


def test_a_call_may_set_its_own_system_turn(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", progress=False)
    rapid = RapidEngine(engine, system="Answer briefly.", gamma=4, policy="always")
    assert "Answer briefly." in rapid.render(engine, CONTEXT, QUESTION)[0]
    assert "Answer briefly." not in rapid.render(engine, CONTEXT, QUESTION, "")[0]
    assert "Be terse." in rapid.render(engine, CONTEXT, QUESTION, "Be terse.")[0]
    config = GenerationConfig(max_new_tokens=12)
    own = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config, system="")
    plain = RapidEngine(engine, gamma=4, policy="always").generate(
        CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    assert own.token_ids == plain.token_ids
    assert own.stats.target_prompt_tokens == plain.stats.target_prompt_tokens


# ---- the prefix cache ------------------------------------------------------------------------

def test_second_question_reuses_the_target_prefix(target):
    rapid = RapidEngine(target, gamma=4, policy="always")
    config = GenerationConfig(max_new_tokens=24)
    first = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    assert not first.stats.target_prefix_hit and first.stats.target_reused_tokens == 0
    rapid._prefix = None  # force the KV store path, not the in-memory copy
    second = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    assert second.stats.target_prefix_hit
    prefix, _ = rapid.render(target, CONTEXT, QUESTION)
    assert second.stats.target_reused_tokens == len(target.tokenizer(prefix)["input_ids"])
    assert second.token_ids == first.token_ids
    other = rapid.generate(CONTEXT, "When does the ferry stop?", chunks=PARAGRAPHS[1:2],
                           config=config)
    assert other.stats.target_prefix_hit  # same document, another question


# ---- invariant 5: after any round both caches equal a fresh prefill ---------------------------

def _fresh_target(model, ids: list[int]) -> KVCache:
    cache = KVCache.empty(model, len(ids) + 1)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


def _assert_cache_equal(a: KVCache, b: KVCache):
    assert a.length == b.length
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(la.keys, lb.keys, atol=1e-4, rtol=0)
        torch.testing.assert_close(la.values, lb.values, atol=1e-4, rtol=0)


def test_caches_equal_fresh_prefill_after_every_round(target):
    engine = target
    chunks = PARAGRAPHS[:2]
    engine.encode_chunks(chunks)
    t_prompt = "\n\n".join(PARAGRAPHS[:3]) + "\n\nQ: " + QUESTION + "\nA:"
    d_prompt = "\n\n".join(chunks) + "\n\nQ: " + QUESTION + "\nA:"
    d_segments = engine.assembly.segments(d_prompt, chunks)[0]
    full = partial = 0
    for temperature in (0.0, 1.0, 3.0):
        pre_t = engine.prefill(engine.assembly.segments(t_prompt)[0], reserve=80)
        pre_d = engine.prefill(d_segments, reserve=80)
        assert pre_d.plan.reused_tokens > 0
        t_ids = list(pre_t.plan.token_ids)
        tside = Side(engine.model, pre_t.cache, pre_t.logits, pre_t.next_position)
        dside = Side(engine.model, pre_d.cache, pre_d.logits, pre_d.next_position)
        config = GenerationConfig(max_new_tokens=24, temperature=temperature, seed=3)
        accepted: list[int] = []
        for rnd in speculate(tside, dside, config, SpeculationConfig(gamma=2)):
            accepted += rnd.tokens
            if rnd.drafted:
                full += rnd.accepted == rnd.drafted
                partial += rnd.accepted < rnd.drafted
            # Target: everything accepted but its pending token.
            in_t = accepted[:len(accepted) - len(tside.pending)]
            _assert_cache_equal(tside.cache, _fresh_target(engine.model, t_ids + in_t))
            assert tside.position == len(t_ids) + len(in_t)
            # Drafter: a fresh stitched prefill, then the accepted tokens it has seen, at once.
            in_d = accepted[:len(accepted) - len(dside.pending)]
            fresh = engine.prefill(d_segments, reserve=80)
            if in_d:
                Side(engine.model, fresh.cache, fresh.logits, fresh.next_position).feed(in_d)
            _assert_cache_equal(dside.cache, fresh.cache)
            assert dside.position == pre_d.next_position + len(in_d)
    assert full and partial, (full, partial)  # both rollback shapes were exercised


# ---- invariant 4, sampled: the output follows p -------------------------------------------------

def _vocab8_model(seed: int, scale: float = 6.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)  # peaked; a negative scale inverts the preferences
    return model


def _wrong_rule(drafts, target_logits, draft_logits, config, **kwargs) -> Verdict:
    """The classic mistake: at a rejection, resample from p instead of the residual."""
    v = accept_drafts(drafts, target_logits, draft_logits, config, **kwargs)
    if v.accepted < len(drafts):
        p = target_logits[v.accepted].float().softmax(-1)
        return Verdict(v.accepted, int(torch.multinomial(p, 1, generator=kwargs["generator"])))
    return v


def _sample_second_tokens(rule, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of the 2nd and 3rd generated token over n runs, and their exact laws under p."""
    # A drafter that disagrees with the target often, so rejections (where a wrong rule shows)
    # are common.
    tm, dm = _vocab8_model(0), _vocab8_model(0, scale=-3.0)
    prompt = [1, 5, 2, 7]
    caches = []
    for m in (tm, dm):
        cache = KVCache.empty(m, 16)
        with torch.inference_mode():
            logits = m(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits[0, -1]
        caches.append((cache, logits))
    config = GenerationConfig(max_new_tokens=3, temperature=1.0)
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(2, 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(n):
            sides = []
            for m, (cache, logits) in zip((tm, dm), caches):
                cache.truncate(len(prompt))  # rollback is all it takes to start again
                sides.append(Side(m, cache, logits, len(prompt)))
            out = []
            for rnd in speculate(*sides, config, SpeculationConfig(gamma=2), generator=gen,
                                 accept=rule):
                out += rnd.tokens
            counts[0, out[1]] += 1
            counts[1, out[2]] += 1
        # Exact laws of tokens 2 and 3 under the target alone.
        seqs = torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])
        with torch.inference_mode():
            logits = tm(input_ids=seqs).logits.float()
        p0 = logits[0, len(prompt) - 1].softmax(-1)
        p1 = logits[::8, len(prompt)].softmax(-1)  # [a, vocab]
        p2 = logits[:, len(prompt) + 1].softmax(-1).view(8, 8, 8)  # [a, b, vocab]
        law1 = p0 @ p1
        law2 = torch.einsum("a,ab,abc->c", p0, p1, p2)
    finally:
        torch.set_num_threads(threads)
    return counts, torch.stack([law1, law2])


def test_sampling_eta0_follows_target_distribution_and_wrong_rule_fails():
    n = 1500
    counts, law = _sample_second_tokens(accept_drafts, n)
    for c, l in zip(counts, law):
        assert chisquare(c.numpy(), (l * n).numpy()).pvalue > 1e-3
    wrong, _ = _sample_second_tokens(_wrong_rule, n)
    worst = min(chisquare(c.numpy(), (l * n).numpy()).pvalue for c, l in zip(wrong, law))
    assert worst < 1e-6


@pytest.fixture
def one_thread():
    """Per-token acceptance loops: one torch thread is ~10x faster than two on tiny tensors."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_acceptance_rule_distribution_on_hand_made_laws(one_thread):
    """One drafted token from q, verified against p: the output law is p (η = 0)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4])
    config = GenerationConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(4)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    zt = torch.stack([p.log(), p.log()])
    for d in drafts.tolist():
        v = accept_drafts([d], zt, q.log()[None], config, generator=gen)
        counts[d if v.accepted else v.token] += 1
    assert chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3


# ---- the augmented distribution -----------------------------------------------------------------
# RAPID's reference code (github.com/John-AI-Lab/RAPID, src/utils.py, `_speculative_sampling`):
#     mask = q >= alpha * q.max();  logits = z - η * where(mask, p - q, 0);  p̂ = softmax(logits)
# with alpha = 0.1. `law_p_hat` writes that law out token by token in float64; the tests compare
# `augmented_probs` (vectorised, float32) with it.

ALPHA = 0.1  # the reference code's `alpha`: the drafter's top set is q ≥ α·max q


def law_p_hat(z: list[float], q: list[float], eta: float) -> list[float]:
    """p̂ by the written law, one token at a time, in Python floats (float64)."""
    z_max = max(z)
    e = [math.exp(zk - z_max) for zk in z]  # exp(-inf) = 0: a token warped away stays away
    p = [ek / sum(e) for ek in e]
    q_max = max(q)
    shifted = []
    for zk, pk, qk in zip(z, p, q):
        in_top_set = qk >= ALPHA * q_max
        shifted.append(zk + eta * (qk - pk) if in_top_set else zk)
    s_max = max(shifted)
    e = [math.exp(sk - s_max) for sk in shifted]
    return [ek / sum(e) for ek in e]


def law_output(p: list[float], p_hat: list[float], q: list[float], residual: str) -> list[float]:
    """The law of the token one verified position emits when the draft comes from q: accepted
    x with probability min(q, p̂)(x), else a draw from the residual."""
    accepted = [min(qk, hk) for qk, hk in zip(q, p_hat)]
    if residual == "rapid":
        r = [max(pk - hk, pk - qk, 0.0) for pk, hk, qk in zip(p, p_hat, q)]
    else:
        r = [max(hk - qk, 0.0) for hk, qk in zip(p_hat, q)]
    reject = 1.0 - sum(accepted)
    return [a + reject * rk / sum(r) for a, rk in zip(accepted, r)]


def _law_cases():
    """Target logits (some warped to -inf, as top-k does) and drafter distributions whose top
    set is neither one token nor the whole vocabulary."""
    cases = []
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        z = torch.randn(40, generator=g, dtype=torch.float64) * 2
        z[torch.randperm(40, generator=g)[:5]] = float("-inf")
        q_logits = torch.randn(40, generator=g, dtype=torch.float64) * (1 + seed)
        cases.append((z, q_logits.softmax(-1)))
    return cases


@pytest.mark.parametrize("eta", [0.5, 2.0, 10.0])
def test_augmented_distribution_follows_the_reference_law(eta):
    for z, q in _law_cases():
        top = q >= ALPHA * q.max()
        assert 1 < int(top.sum()) < len(q)
        expected = torch.tensor(law_p_hat(z.tolist(), q.tolist(), eta), dtype=torch.float64)
        z32, q32 = z.float(), q.float()
        got = augmented_probs(z32, z32.softmax(-1), q32, eta)
        torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)
        # the tail keeps the target's proportions: p̂ ∝ p outside the top set (and 0 stays 0)
        p = z.softmax(-1)
        tail = ~top & (p > 0)
        ratio = expected[tail] / p[tail]
        torch.testing.assert_close(ratio, ratio[:1].expand_as(ratio))
        assert torch.equal(got[p == 0], torch.zeros_like(got[p == 0]))


def test_augmented_distribution_on_a_batch_of_positions():
    z = torch.stack([c[0] for c in _law_cases()]).float()
    q = torch.stack([c[1] for c in _law_cases()]).float()
    got = augmented_probs(z, z.softmax(-1), q, 3.0)
    for row, (zr, qr) in zip(got, _law_cases()):
        expected = torch.tensor(law_p_hat(zr.tolist(), qr.tolist(), 3.0))
        torch.testing.assert_close(row, expected, atol=1e-6, rtol=1e-5)


def test_augmented_distribution_at_eta0_is_p_itself():
    z, q = _law_cases()[0]
    p = z.float().softmax(-1)
    assert augmented_probs(z.float(), p, q.float(), 0.0) is p


# A position where the target's favourite (token 0) is in the drafter's tail: the law leaves its
# logit alone, so p̂ keeps it high; a shift applied to every token would push it down.
P_HAND = [0.55, 0.25, 0.15, 0.05]
Q_HAND = [0.01, 0.60, 0.04, 0.35]


@pytest.mark.parametrize("residual", ["rapid", "standard"])
def test_sampled_acceptance_with_eta_follows_the_written_law(residual, one_thread):
    eta = 4.0
    z = [math.log(x) for x in P_HAND]
    p_hat = law_p_hat(z, Q_HAND, eta)
    law = torch.tensor(law_output(P_HAND, p_hat, Q_HAND, residual))
    if residual == "standard":
        torch.testing.assert_close(law, torch.tensor(p_hat, dtype=law.dtype))  # follows p̂
    q = torch.tensor(Q_HAND)
    zt = torch.tensor([z, z])
    config = GenerationConfig(temperature=1.0)
    gen = torch.Generator().manual_seed(5)
    n = 8000  # the law of a shift on every token differs by χ² ≈ 170 at this n
    counts = torch.zeros(4)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    for d in drafts.tolist():
        v = accept_drafts([d], zt, q.log()[None], config, eta=eta, residual=residual,
                          generator=gen)
        counts[d if v.accepted else v.token] += 1
    assert chisquare(counts.numpy(), (law * n).numpy()).pvalue > 1e-3


def test_residual_reduces_to_standard_at_eta0():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    r = residual_probs(p, augmented_probs(p.log(), p, q, 0.0), q)
    torch.testing.assert_close(r, torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual_probs(p, p, q, "standard"), r)


def test_greedy_with_eta_uses_argmax_of_p_hat():
    # target prefers 0 narrowly; the drafter strongly prefers 1: p̂ at T=1 flips to 1
    zt = torch.tensor([[1.0, 0.9, -5.0], [0.0, 0.0, 5.0]])
    zq = torch.tensor([[-5.0, 5.0, -5.0]])
    config = GenerationConfig()
    assert accept_drafts([1], zt, zq, config, eta=0.0) == Verdict(0, 0)
    assert accept_drafts([1], zt, zq, config, eta=3.0) == Verdict(1, 2)
    # the target's argmax (0) is in the drafter's tail: its logit does not move, so it stays the
    # argmax of p̂ and the drafted 1 is rejected (a shift of every logit would have accepted it)
    zt = torch.tensor([[1.0, 0.9, -5.0], [0.0, 0.0, 5.0]])
    zq = torch.tensor([[0.0, math.log(50.0), math.log(49.0)]])  # q ≈ (0.01, 0.5, 0.49)
    z, q = zt[0].tolist(), zq[0].softmax(-1).tolist()
    assert max(range(3), key=law_p_hat(z, q, 1.0).__getitem__) == 0
    assert accept_drafts([1], zt, zq, config, eta=1.0) == Verdict(0, 0)


# ---- verification attention -------------------------------------------------------------------

def test_split_attention_matches_masked_sdpa():
    torch.manual_seed(0)
    q = torch.randn(1, 6, 5, 16)
    k = torch.randn(1, 2, 40, 16)
    v = torch.randn(1, 2, 40, 16)
    mask = torch.ones(5, 40, dtype=torch.bool)
    mask[:, 35:] = torch.ones(5, 5, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(split_attention(q, k, v, None), ref, atol=1e-5, rtol=1e-5)


def test_suffix_causal_forward_matches_stock(tiny):
    model = tiny.model
    ids = torch.randint(0, 250, (1, 60))
    outs = []
    for split in (False, True):
        cache = KVCache.empty(model, 64)
        with torch.inference_mode():
            model(input_ids=ids[:, :49], cache=cache, use_cache=True)
            with suffix_causal(model, split):
                outs.append(model(input_ids=ids[:, 49:], position_ids=torch.arange(49, 60)[None],
                                  cache=cache, use_cache=True).logits)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
    assert model.config._attn_implementation == "sdpa"  # restored


# ---- bad input ----------------------------------------------------------------------------------

def test_vocabulary_mismatch_is_refused(tiny_llama, tmp_path):
    other_tok = byte_tokenizer()
    other_tok.add_tokens(["<extra>"])
    other = LoadedModel(name="other-vocab", model=tiny_model("llama", seed=2).model,
                        tokenizer=other_tok, source="memory")
    t = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", progress=False)
    d = TurboRAGEngine(other, store=tmp_path / "kv", progress=False)
    with pytest.raises(VocabularyMismatch, match="tiny-llama-0.*other-vocab"):
        RapidEngine(t, d)


def test_context_longer_than_target_window_fails_before_compute(target):
    rapid = RapidEngine(target, policy="always")
    calls = []
    handle = target.model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ContextWindowError) as err:
            rapid.generate("word " * 600, QUESTION, chunks=[])
    finally:
        handle.remove()
    assert calls == []
    prefix, suffix = rapid.render(target, "word " * 600, QUESTION)
    length = sum(len(target.tokenizer(t, add_special_tokens=False)["input_ids"])
                 for t in (prefix, suffix))
    # both lengths: the prompt's and the target's window
    assert f"the prompt is {length} tokens" in str(err.value)
    assert "context window 2048" in str(err.value)


def test_bad_parameters(target):
    with pytest.raises(ValueError):
        RapidEngine(target, gamma=0)
    with pytest.raises(ValueError):
        RapidEngine(target, eta=-1)
    with pytest.raises(ValueError):
        RapidEngine(target, residual="nope")
    for eta in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eta must be"):
            RapidEngine(target, eta=eta)
    for p in (-0.1, 1.0, float("nan")):
        with pytest.raises(ValueError, match="min_draft_prob"):
            RapidEngine(target, min_draft_prob=p)
    with pytest.raises(ValueError, match="drafter_quantize"):
        RapidEngine(target, drafter_quantize="int4")
    with pytest.raises(ValueError, match="min_drafter_tokens"):
        RapidEngine(target, min_drafter_tokens=-1)


def test_streaming_and_stop_strings(target):
    rapid = RapidEngine(target, gamma=4, policy="always")
    config = GenerationConfig(max_new_tokens=30)
    whole = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    stream = rapid.stream(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    assert "".join(stream) == whole.text
    assert stream.result.token_ids == whole.token_ids
    # a stop string taken from the answer itself, so the check always runs
    assert len(whole.text) > 4, whole.text
    stop = whole.text[2:4]
    cut = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1],
                         config=GenerationConfig(max_new_tokens=30, stop=[stop]))
    assert cut.stats.finish_reason == "stop"
    assert cut.text == whole.text[:whole.text.index(stop)]  # cut right before it, nothing leaked


def test_per_call_settings_are_validated_before_any_compute(target):
    rapid = RapidEngine(target, policy="always")
    for kwargs in ({"gamma": 0}, {"eta": -0.5}, {"eta": float("nan")}, {"eta": float("inf")}):
        with pytest.raises(ValueError):
            rapid.stream(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], **kwargs)


def test_early_close_releases_both_caches_and_keeps_partial_stats(target):
    rapid = RapidEngine(target, gamma=3, policy="always")
    config = GenerationConfig(max_new_tokens=20)
    fresh = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    target.cache_pool.keep = 4
    target.cache_pool._free.clear()
    stream = rapid.stream(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    next(iter(stream))
    assert target.cache_pool._free == []  # both caches in use
    stream.close()
    assert stream.result.stats.finish_reason == "cancelled"
    assert stream.result.stats.ttft_s > 0 and stream.result.stats.gamma == 3
    assert len(target.cache_pool._free) == 2  # target's and drafter's, handed back
    again = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    assert again.token_ids == fresh.token_ids


def test_given_chunks_reach_the_drafter_in_document_order(target):
    from turborag_integrations.core.rapid import document_order

    assert document_order("a b c", ["c", "zz", "a", " "]) == ["a", "c", "zz"]
    rapid = RapidEngine(target, gamma=2, policy="always")
    config = GenerationConfig(max_new_tokens=8)
    ordered = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:3], config=config)
    shuffled = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[2::-1], config=config)
    assert shuffled.token_ids == ordered.token_ids
    assert shuffled.stats.accepted == ordered.stats.accepted
    assert shuffled.stats.drafter_prompt_tokens == ordered.stats.drafter_prompt_tokens


# ---- speed switches: a cheaper drafter, adaptive draft length, the reference context ----------

def test_int8_drafter_keeps_eta0_lossless(pair):
    from turborag_integrations.core.decode.fast import FastDecoder
    from turborag_integrations.core.decode.matmul import int8_available

    if not int8_available():
        pytest.skip("no int8 dynamic quantisation in this torch build")
    t, d = pair
    rapid = RapidEngine(t, d, gamma=4, drafter_quantize="int8", policy="always")
    out = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1],
                         config=GenerationConfig(max_new_tokens=40))
    assert out.token_ids == reference(rapid, 40)
    assert out.stats.drafted > 0 and out.stats.draft_steps > 0
    # the drafter stepped on its int8 copy; the target has no reduced-precision decoder
    from turborag_integrations.core.decode import fast

    assert any(k[0] == "int8" for k in fast._decoders[d.model])
    assert all(k[0] is None for k in fast._decoders.get(t.model, {}))
    FastDecoder.forget(d.model)


def test_sampled_int8_drafter_runs_and_fp32_target_decides(pair):
    t, d = pair
    rapid = RapidEngine(t, d, gamma=3, drafter_quantize="int8", policy="always")
    config = GenerationConfig(max_new_tokens=20, temperature=0.8, seed=3)
    a = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    b = rapid.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0  # seeded: repeatable


def test_adaptive_draft_length_stops_early_and_stays_lossless(pair):
    t, d = pair
    fixed = RapidEngine(t, d, gamma=8, policy="always")
    adaptive = RapidEngine(t, d, gamma=8, min_draft_prob=0.9, policy="always")
    config = GenerationConfig(max_new_tokens=40)
    a = fixed.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    b = adaptive.generate(CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=config)
    assert a.token_ids == b.token_ids == reference(fixed, 40)
    # a random drafter is rarely 90% sure: rounds end before γ drafts
    assert b.stats.drafted < 8 * b.stats.rounds
    assert b.stats.drafted >= b.stats.rounds  # at least one draft per round
    assert a.stats.drafted > b.stats.drafted


def test_round_costs_are_measured(pair):
    t, d = pair
    out = RapidEngine(t, d, gamma=4, policy="always").generate(
        CONTEXT, QUESTION, chunks=PARAGRAPHS[:1], config=GenerationConfig(max_new_tokens=24))
    s = out.stats
    assert s.rounds > 0 and s.draft_steps >= s.rounds
    assert s.draft_s > 0 and s.verify_s > 0
    assert s.draft_step_ms == 1e3 * s.draft_s / s.draft_steps
    assert s.verify_ms == 1e3 * s.verify_s / s.rounds
    assert {"draft_step_ms", "verify_ms"} <= set(s.as_dict())


def test_reference_context_preset(target):
    from turborag_integrations.core.rapid import REFERENCE_CONTEXT

    rapid = RapidEngine.reference(target, gamma=3, policy="always")
    assert rapid.config.chunk_tokens == 128 and rapid.config.speculation.gamma == 3
    assert REFERENCE_CONTEXT["chunk_tokens"] == 128
    # max(|C| / 32, 4096), never more than the context itself
    assert rapid.drafter_budget(100_000) == 4096
    assert rapid.drafter_budget(262_144) == 8192
    assert rapid.drafter_budget(1_000) == 1_000
    # the defaults: min(4096, |C| / 4)
    default = RapidEngine(target)
    assert default.drafter_budget(8_000) == 2_000
    assert default.drafter_budget(100_000) == 4096
    # no threshold: the whole (short) context fits, in document order
    ctx = rapid.drafter_context(CONTEXT, "Which company fires tiles?")
    positions = [CONTEXT.index(c) for c in ctx.chunks]
    assert positions == sorted(positions)
    assert ctx.tokens == sum(len(target.tokenizer(c, add_special_tokens=False)["input_ids"])
                             for c in ctx.chunks)
    assert ctx.retrieved == ctx.candidates and len(ctx.chunks) == ctx.candidates
    out = rapid.generate(CONTEXT, QUESTION, config=GenerationConfig(max_new_tokens=16))
    assert out.token_ids == reference(rapid, 16)


def test_changed_chunk_size_is_not_served_stale_chunks(tiny_llama, tmp_path):
    engine = TurboRAGEngine(tiny_llama, store=tmp_path / "kv", progress=False)
    rapid = RapidEngine(engine, chunk_tokens=80, threshold=-1.0, compression=1.0, policy="always")
    big = rapid.drafter_context(CONTEXT, QUESTION).candidates
    rapid.config = rapid.config.with_settings(chunk_tokens=40)
    small = rapid.drafter_context(CONTEXT, QUESTION).candidates
    assert small > big


def test_drafter_prefix_cache_for_a_full_context_drafter(pair):
    """cached_prefill/save_prefix work for the drafter too (naive speculative decoding)."""
    t, d = pair
    rapid = RapidEngine(t, d, policy="always")
    prefix, suffix = rapid.render(d, CONTEXT, QUESTION)
    pre, key, hit = rapid.cached_prefill(d, prefix, suffix, 8)
    assert not hit
    ids = d.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    rapid.save_prefix(d, key, pre.cache, ids)
    again, key2, hit2 = rapid.cached_prefill(d, prefix, suffix, 8)
    assert hit2 and key2 == key and again.plan.reused_tokens == len(ids)
    torch.testing.assert_close(again.logits, pre.logits, atol=1e-4, rtol=0)
    assert rapid._prefix is None  # only the target's prefix is kept in memory
    d.cache_pool.release(pre.cache)
    d.cache_pool.release(again.cache)


def test_verification_product_is_chosen_apart_from_the_step(tiny_llama):
    """rows_matmul (several tokens of one sequence) follows an explicit matmul, is timed under
    "auto", and a forward through it equals one-token steps up to rounding."""
    from turborag_integrations.core.decode.fast import FastDecoder

    model = tiny_llama.model
    for mode in ("linear", "gemm"):
        fast = FastDecoder(model, matmul=mode)
        assert fast.matmul == fast.rows_matmul == mode
    auto = FastDecoder(model, matmul="auto")
    assert auto.rows_matmul in ("linear", "gemm") and auto.matmul in ("linear", "gemm")
    auto.rows_matmul, auto.matmul = "gemm", "linear"  # the mix the pair measured
    ids = list(range(10, 40))
    feed = [3, 9, 27, 81]
    caches = [KVCache.empty(model, 64) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:
            model(input_ids=torch.tensor([ids]), cache=c, use_cache=True)
        together = auto.forward(feed, len(ids), caches[0])
        apart = torch.stack([auto.step(t, len(ids) + i, caches[1]) for i, t in enumerate(feed)])
    torch.testing.assert_close(together, apart, atol=1e-4, rtol=1e-4)
