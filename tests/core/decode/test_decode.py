"""The fast decode path: bit-identical to the stock forward, token-identical to HF generate."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.conftest import tiny_model
from turborag_integrations.core.kv.cache import KVCache
from turborag_integrations.core.decode.fast import FastDecoder, stock_step, unsupported_reason
from turborag_integrations.core.decode.matmul import gemm, int8_available
from turborag_integrations.core.decode.loop import decode_loop, step_function
from turborag_integrations.core.decode.start import DecodeStart
from turborag_integrations.core.settings import GenerationConfig


def prefill(model, ids, capacity=64):
    cache = KVCache.empty(model, len(ids) + capacity)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[0, -1]


def prompt_ids(tokenizer, text="The lighthouse keeper said that"):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def hf_greedy(model, ids, n, pad_token_id):
    """HF generate's greedy continuation of `ids`: n tokens, or fewer ending at end-of-sequence.

    Not min_new_tokens=n: it masks the end-of-sequence logit, so where the model's argmax is
    end-of-sequence the reference would pick the runner-up. Compare with `matches_reference`.
    """
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=pad_token_id)
    tokens = out[0, len(ids):].tolist()
    eos = generate_eos(model)
    cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


def generate_eos(model) -> set[int]:
    """The end-of-sequence ids HF generate stops at: the model's generation config's."""
    value = model.generation_config.eos_token_id
    return set() if value is None else set(value if isinstance(value, (list, tuple)) else [value])


def matches_reference(got, ref, n, model):
    """`got` (n tokens, decoded past end-of-sequence) starts with `ref`, and a shorter `ref`
    ended at end-of-sequence."""
    return got[:len(ref)] == ref and (len(ref) == n or ref[-1] in generate_eos(model))


def test_tiny_models_answer_different_prompts_differently(tiny):
    """The tiny models' outputs depend on the prompt: tests that compare two decodes of the same
    prompt would pass trivially on a model that always says the same thing."""
    model, tok = tiny.model, tiny.tokenizer
    answers = []
    for text in ("Once upon a time", "The river Xan flows north", "Bob keeps three", "1901"):
        ids = prompt_ids(tok, text)
        cache, logits = prefill(model, ids, 12)
        answers.append(tuple(decode_loop(model, DecodeStart(cache, logits, len(ids)),
                                         GenerationConfig(max_new_tokens=12), set())))
    assert len(set(answers)) >= 3
    assert all(len(set(a)) >= 2 for a in answers)


def test_fast_step_is_bit_identical_to_stock_forward(tiny):
    model, tok = tiny.model, tiny.tokenizer
    ids = prompt_ids(tok)
    a, _ = prefill(model, ids)
    b, _ = prefill(model, ids)
    fast = FastDecoder.for_model(model, matmul="linear")  # F.linear: the stock arithmetic
    assert fast is not None
    with torch.inference_mode():
        for i, token in enumerate([5, 77, 130, 9]):
            x = stock_step(model, token, len(ids) + i, a)
            y = fast(token, len(ids) + i, b)
            assert torch.equal(x, y)
    assert a.length == b.length == len(ids) + 4
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_fast_step_works_with_a_dynamic_cache(tiny_llama):
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    ids = torch.tensor([prompt_ids(tok)])
    caches = []
    for _ in range(2):
        c = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=ids, cache=c, use_cache=True)
        caches.append(c)
    with torch.inference_mode():
        x = stock_step(model, 42, ids.shape[1], caches[0])
        y = FastDecoder.for_model(model, matmul="linear")(42, ids.shape[1], caches[1])
    assert torch.equal(x, y)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_greedy_decode_matches_hf_generate(model_type):
    loaded = tiny_model(model_type, seed=3)
    model, tok = loaded.model, loaded.tokenizer
    ids = prompt_ids(tok, "Once upon a time")
    n = 24
    ref = hf_greedy(model, ids, n, tok.pad_token_id)
    cache, logits = prefill(model, ids, n)
    got = list(decode_loop(model, DecodeStart(cache, logits, len(ids)),
                           GenerationConfig(max_new_tokens=n), set()))
    assert len(got) == n and matches_reference(got, ref, n, model)


def test_sampling_matches_the_stock_loop_for_a_seed(tiny):
    model, tok = tiny.model, tiny.tokenizer
    ids = prompt_ids(tok)
    config = GenerationConfig(max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    runs = []
    for fast in (True, False):
        cache, logits = prefill(model, ids)
        runs.append(list(decode_loop(model, DecodeStart(cache, logits, len(ids)), config, set(),
                                     fast=fast)))
    assert runs[0] == runs[1]
    assert len(runs[0]) == 20


def test_unsupported_models_fall_back_to_the_stock_forward():
    loaded = tiny_model("llama", attn="eager")
    model = loaded.model
    assert unsupported_reason(model) is None  # eager is supported
    model.train()
    try:
        assert "training" in unsupported_reason(model)
        assert FastDecoder.for_model(model) is None
        ids = prompt_ids(loaded.tokenizer)
        cache, logits = prefill(model, ids)
        # the stock step still decodes
        out = list(decode_loop(model, DecodeStart(cache, logits, len(ids)),
                               GenerationConfig(max_new_tokens=3), set()))
        assert len(out) == 3
    finally:
        model.eval()
    handle = model.model.layers[0].register_forward_hook(lambda *a: None)
    try:
        assert "hooks" in unsupported_reason(model)
    finally:
        handle.remove()


def test_eager_fast_path_matches_stock():
    loaded = tiny_model("qwen2", attn="eager")
    model, ids = loaded.model, prompt_ids(loaded.tokenizer)
    a, _ = prefill(model, ids)
    b, _ = prefill(model, ids)
    with torch.inference_mode():
        x = stock_step(model, 11, len(ids), a)
        y = FastDecoder.for_model(model)(11, len(ids), b)
    torch.testing.assert_close(x, y, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "bf16"])
def test_quantised_modes_decode_close_to_fp32(tiny, mode):
    if mode == "int8" and not int8_available():
        pytest.skip("no int8 dynamic quantisation in this torch build")
    model, ids = tiny.model, prompt_ids(tiny.tokenizer)
    a, _ = prefill(model, ids)
    b, _ = prefill(model, ids)
    with torch.inference_mode():
        x = FastDecoder.for_model(model)(5, len(ids), a)
        y = FastDecoder.for_model(model, mode)(5, len(ids), b)
    rel = (x - y).norm() / x.norm()
    assert rel < (0.1 if mode == "int8" else 0.02)
    # the cache holds full-precision keys/values either way, and grew by one token
    assert a.length == b.length == len(ids) + 1
    # The new token's keys and values come from the reduced-precision q/k/v projection, biases
    # included: close to full precision's (measured ≤ 0.015 int8, ≤ 0.004 bf16); a dropped or
    # misplaced qwen2 bias would be off by about 100%.
    n = len(ids)
    for la, lb in zip(a.layers, b.layers):
        for full, reduced in ((la.keys, lb.keys), (la.values, lb.values)):
            row = full[..., n, :]
            assert (row - reduced[..., n, :]).norm() / row.norm() < (0.05 if mode == "int8" else 0.01)
    # the quantised decoder is built once and cached per model and mode
    assert FastDecoder.for_model(model, mode) is FastDecoder.for_model(model, mode)
    FastDecoder.forget(model)


def test_quantize_is_validated_and_falls_back_when_impossible(tiny_llama, caplog):
    with pytest.raises(ValueError):
        GenerationConfig(quantize="int4")
    model = tiny_llama.model
    step = step_function(model, "int8", fast=False)  # stock path: no quantisation, a warning
    assert "full precision" in caplog.text
    ids = prompt_ids(tiny_llama.tokenizer)
    cache, _ = prefill(model, ids)
    with torch.inference_mode():
        assert step(3, len(ids), cache).shape == (model.config.vocab_size,)


@pytest.mark.real_model
def test_real_model_greedy_matches_hf_generate(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = prompt_ids(tok, text)
    n = 12
    ref = hf_greedy(model, ids, n, tok.eos_token_id)
    cache, logits = prefill(model, ids, n)
    got = list(decode_loop(model, DecodeStart(cache, logits, len(ids)),
                           GenerationConfig(max_new_tokens=n), set()))
    assert len(got) == n and matches_reference(got, ref, n, model)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_gemm_equals_linear_up_to_rounding(rows):
    torch.manual_seed(0)
    w, b = torch.randn(300, 64), torch.randn(300)
    x = torch.randn(1, rows, 64)
    ref = torch.nn.functional.linear(x, w, b)
    got = gemm(x, w, b)
    assert got.shape == ref.shape == (1, rows, 300)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gemm_decoder_decodes_like_stock(model_type):
    """The gemm formulation changes only the summation order: logits within rounding and the
    same greedy tokens as HF generate."""
    loaded = tiny_model(model_type, seed=3)
    model, tok = loaded.model, loaded.tokenizer
    ids = prompt_ids(tok, "Once upon a time")
    a, _ = prefill(model, ids)
    b, _ = prefill(model, ids)
    fast = FastDecoder.for_model(model, matmul="gemm")
    assert fast.matmul == "gemm"
    with torch.inference_mode():
        for i, token in enumerate([5, 77, 130, 9]):
            torch.testing.assert_close(fast(token, len(ids) + i, b),
                                       stock_step(model, token, len(ids) + i, a),
                                       rtol=1e-5, atol=1e-4)
    n = 24
    ref = hf_greedy(model, ids, n, tok.pad_token_id)
    cache, logits = prefill(model, ids, n)
    out, token, pos = [], int(logits.argmax()), len(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(token)
            token = int(fast(token, pos, cache).argmax())
            pos += 1
    assert matches_reference(out, ref, n, model)


def test_matmul_is_validated(tiny_llama, monkeypatch):
    with pytest.raises(ValueError, match="matmul"):
        FastDecoder.for_model(tiny_llama.model, matmul="blas")
    monkeypatch.setenv("TURBORAG_DECODE_MATMUL", "gemm")
    assert FastDecoder.for_model(tiny_llama.model).matmul == "gemm"
    assert FastDecoder.for_model(tiny_llama.model, matmul="auto").matmul in ("gemm", "linear")


@pytest.mark.parametrize("matmul", ["linear", "gemm"])
def test_several_tokens_in_one_forward_equal_one_by_one(tiny, matmul):
    """forward(tokens) (verification) = the same tokens fed one step at a time: logits and the
    keys/values appended to the cache."""
    model, ids = tiny.model, prompt_ids(tiny.tokenizer)
    fast = FastDecoder.for_model(model, matmul=matmul)
    feed = [5, 77, 130, 9, 41]
    a, _ = prefill(model, ids)
    b, _ = prefill(model, ids)
    with torch.inference_mode():
        steps = torch.stack([fast(t, len(ids) + i, a) for i, t in enumerate(feed)])
        together = fast.forward(feed, len(ids), b)
    torch.testing.assert_close(together, steps, rtol=1e-5, atol=1e-4)
    assert a.length == b.length == len(ids) + len(feed)
    for la, lb in zip(a.layers, b.layers):
        torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lb.values, la.values, rtol=1e-5, atol=1e-5)


def test_decode_loop_takes_its_matmul_without_the_environment(tiny_llama, monkeypatch):
    """A caller picks the products per call; the environment is only the default."""
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    monkeypatch.setenv("TURBORAG_DECODE_MATMUL", "gemm")
    ids = prompt_ids(tok)
    config = GenerationConfig(max_new_tokens=6)
    runs = {}
    for matmul, fast in (("linear", True), (None, False)):
        cache, logits = prefill(model, ids)
        runs[matmul] = list(decode_loop(model, DecodeStart(cache, logits, len(ids)), config, set(),
                                        fast=fast, matmul=matmul))
    assert runs["linear"] == runs[None]  # F.linear decodes as the stock forward does
    assert step_function(model, matmul="linear").__self__.matmul == "linear"
    assert step_function(model).__self__.matmul == "gemm"  # the environment's default
    cache, logits = prefill(model, ids)
    with pytest.raises(ValueError, match="matmul"):
        next(iter(decode_loop(model, DecodeStart(cache, logits, len(ids)), config, set(),
                              matmul="blas")))
