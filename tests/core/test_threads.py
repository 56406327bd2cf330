"""Concurrent requests on one model: the attention switches (split verification attention,
masked GQA on CPU) hold for the calling thread's forwards only and write no shared state."""

from __future__ import annotations

import os
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import tiny_model
from turborag_integrations.core import attention
from turborag_integrations.core.attention import sdpa_gqa, suffix_causal
from turborag_integrations.core.decode.matmul import int8_available
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.kv.cache import KVCache
from turborag_integrations.core.rapid import RapidEngine, Side, speculate
from turborag_integrations.core.settings import GenerationConfig, SpeculationConfig
from turborag_integrations.core.prompt_template import render_chat

CPU = torch.device("cpu")
PARAGRAPHS = [
    "The Tall Widow lighthouse stands 41 metres high.",
    "The ferry stops every January, when the harbour freezes.",
    "Mirrored sunlight heats the kiln to 1600 degrees.",
]
CONTEXT = "\n\n".join(PARAGRAPHS)
QUESTIONS = ["How high is the lighthouse?", "When does the ferry stop?", "How hot is the kiln?"]
NEW_TOKENS = 8
GAMMA = 3
DRAFT = "int8" if int8_available() else "bf16"
KINDS = ["turbo", "naive", "draft", "rapid", "rapid-stock"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path_factory.mktemp("kv"),
                            progress=False)
    engine.encode_chunks(PARAGRAPHS)
    return engine, RapidEngine(engine, gamma=GAMMA)


def answer(engine: TurboRAGEngine, rapid: RapidEngine, kind: str, question: str) -> list[int]:
    """Greedy answer of one request of `kind`."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, draft=DRAFT if kind == "draft" else None)
    if kind == "rapid":
        return rapid.generate(CONTEXT, question, chunks=PARAGRAPHS[:1], config=config).token_ids
    if kind == "rapid-stock":
        return stock_rapid(engine, rapid, question)
    # The chunks are separated by plain text, so the turbo prefill is a masked forward.
    prompt = render_chat(engine.tokenizer, [{"role": "user", "content": f"{CONTEXT}\n\n{question}"}])
    return engine.generate(prompt, chunks=PARAGRAPHS, config=config,
                           mode="naive" if kind == "naive" else "turbo").token_ids


def stock_rapid(engine: TurboRAGEngine, rapid: RapidEngine, question: str) -> list[int]:
    """RAPID through the model's own forward (`Side(fast=False)`), so that verification runs
    under `suffix_causal` and `sdpa_gqa`."""
    reserve = NEW_TOKENS + GAMMA + 2
    pres = []
    try:
        for context in (CONTEXT, PARAGRAPHS[0]):
            prompt = "".join(rapid.render(engine, context, question))
            segments, _, _ = engine.assembly.segments(prompt, PARAGRAPHS)
            pres.append(engine.prefill(segments, reserve=reserve))
        target, drafter = (Side(engine.model, p.cache, p.logits, p.next_position, fast=False)
                           for p in pres)
        rounds = speculate(target, drafter, GenerationConfig(max_new_tokens=NEW_TOKENS),
                           SpeculationConfig(gamma=GAMMA), eos_ids=engine.eos_ids)
        return [t for r in rounds for t in r.tokens]
    finally:
        for p in pres:
            engine.cache_pool.release(p.cache)


def test_without_a_switch_the_stock_sdpa_function_runs():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with sdpa_gqa(CPU):  # installs the wrapper
        pass
    assert ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None) is attention.attention_forward
    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True)
    q, k, v = torch.randn(1, 6, 5, 16), torch.randn(1, 2, 20, 16), torch.randn(1, 2, 20, 16)
    mask = torch.ones(5, 20, dtype=torch.bool)
    mask[:, 15:] = torch.ones(5, 5, dtype=torch.bool).tril()
    for m in (None, mask[None, None]):
        stock = sdpa_attention_forward(module, q, k, v, m, scaling=0.25)[0]
        assert torch.equal(attention.attention_forward(module, q, k, v, m, scaling=0.25)[0], stock)
        with sdpa_gqa(CPU):
            gqa = attention.attention_forward(module, q, k, v, m, scaling=0.25)[0]
        torch.testing.assert_close(gqa, stock)


def test_switches_hold_in_their_own_thread_only(tiny_llama, monkeypatch):
    model = tiny_llama.model
    split_threads = []
    real_split = attention.split_attention

    def recording_split(*args):
        split_threads.append(threading.get_ident())
        return real_split(*args)

    monkeypatch.setattr(attention, "split_attention", recording_split)
    ids = torch.randint(0, 250, (1, 40), generator=torch.Generator().manual_seed(0))

    def verify() -> torch.Tensor:
        """8 new tokens over a 32-token cache in one forward."""
        cache = KVCache.empty(model, 48)
        with torch.inference_mode():
            model(input_ids=ids[:, :32], cache=cache, use_cache=True)
            return model(input_ids=ids[:, 32:], position_ids=torch.arange(32, 40)[None],
                         cache=cache, use_cache=True).logits

    stock = verify()
    inside, release = threading.Event(), threading.Event()
    switched = {}

    def holder():
        with suffix_causal(model), sdpa_gqa(CPU):
            inside.set()
            release.wait(30)
            switched["logits"] = verify()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(30)
        other = verify()  # while the other thread's switches are on
    finally:
        release.set()
        thread.join(30)
    assert torch.equal(other, stock)
    assert split_threads and set(split_threads) == {thread.ident}
    torch.testing.assert_close(switched["logits"], stock, atol=1e-4, rtol=0)


def test_masked_prefill_uses_grouped_query_sdpa(engines, monkeypatch):
    engine, rapid = engines
    answer(engine, rapid, "turbo", QUESTIONS[0])  # first use encodes the prompt's prefix blob
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is not None, kwargs.get("enable_gqa", False)))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    answer(engine, rapid, "turbo", QUESTIONS[0])
    assert (True, True) in calls  # the masked prefill, without repeat_kv
    assert (True, False) not in calls


def test_no_environment_or_config_writes(engines, monkeypatch):
    engine, rapid = engines
    config = engine.model.config
    before = (dict(os.environ), config._attn_implementation)
    writes = []
    env_type = type(os.environ)
    for name in ("__setitem__", "__delitem__"):
        real = getattr(env_type, name)
        monkeypatch.setattr(env_type, name, lambda self, key, *value, _real=real:
                            (writes.append(("environ", key)), _real(self, key, *value))[1])
    config_type = type(config)
    real_setattr = config_type.__setattr__

    def recording_setattr(self, key, value):
        if self is config:
            writes.append(("config", key))
        real_setattr(self, key, value)

    monkeypatch.setattr(config_type, "__setattr__", recording_setattr)
    # Watch from another thread too, while the forwards run.
    seen, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            seen.add((os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA"), config._attn_implementation))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for kind in ("turbo", "rapid", "rapid-stock"):
            answer(engine, rapid, kind, QUESTIONS[1])
    finally:
        done.set()
        watcher.join(30)
    assert writes == []
    assert seen == {(None, "sdpa")}
    assert (dict(os.environ), config._attn_implementation) == before


def test_mixed_requests_from_eight_threads_on_one_engine(engines):
    engine, rapid = engines
    requests = [(kind, q) for kind in KINDS for q in QUESTIONS]
    for kind, q in requests:  # first use encodes prefixes and fills the prefix cache
        answer(engine, rapid, kind, q)
    solo = {(kind, q): answer(engine, rapid, kind, q) for kind, q in requests}
    start = threading.Barrier(8)

    def worker(seed: int) -> list[tuple[str, str, list[int]]]:
        rng = random.Random(seed)
        start.wait(60)
        out = []
        for _ in range(25):
            kind, q = rng.choice(requests)
            out.append((kind, q, answer(engine, rapid, kind, q)))
        return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for f in [pool.submit(worker, s) for s in range(8)] for r in f.result()]
    assert len(results) == 200
    assert {kind for kind, _, _ in results} == set(KINDS)
    wrong = [(kind, q) for kind, q, got in results if got != solo[(kind, q)]]
    assert wrong == []
    assert engine.model.config._attn_implementation == "sdpa"


def test_on_own_thread_returns_the_result_or_raises_the_error_of_another_thread():
    import threading

    from turborag_integrations.core.batching import on_own_thread

    main = threading.get_ident()
    assert on_own_thread(threading.get_ident) != main
    with pytest.raises(ValueError, match="no model"):
        on_own_thread(lambda: (_ for _ in ()).throw(ValueError("no model")))
