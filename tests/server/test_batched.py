"""Requests decoded together behind a live server: every concurrent greedy answer, whole or
streamed, equals the answer the engine gives the same prompt alone; and the naive mode, the
baseline that reuses nothing."""

import threading

import httpx
import pytest

from turborag_integrations.core.prefill.recovery import parse_recovery
from turborag_integrations.core.settings import DEFAULT_RECOVERY, GenerationConfig
from turborag_integrations.server.app import create_app

from .conftest import DOCS, final_stats, running, sse_events
from turborag_integrations.core.prompt_template import render_chat

QUESTIONS = ["How high is the lighthouse?", "When does the ferry stop?", "What does the kiln fire?",
             "Who lit the lamp first?", "Why does the harbour freeze?", "Where are the mirrors?"]


def messages(i: int) -> list[dict]:
    """Prompts of different lengths over different pairs of the ingested documents."""
    context = "\n\n".join([DOCS[i % 3], DOCS[(i + 1) % 3]])
    return [{"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {QUESTIONS[i]}"
                                        f"{' Explain.' * i}"}]


def answer(url: str, body: dict) -> tuple[str, dict]:
    """The text of a chat completion, whole or streamed, and its TurboRAG figures."""
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()["choices"][0]["message"]["content"], r.json()["turborag"]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(r.content)
                   if isinstance(e, dict) and e["choices"])
    return text, final_stats(r.content)


@pytest.fixture(scope="module")
def server(engine):
    app = create_app(engine)
    with running(app) as url:
        r = httpx.post(f"{url}/v1/turborag/chunks", json={"texts": DOCS}, timeout=120)
        assert r.status_code == 200
        yield url, app


def test_concurrent_answers_equal_their_answers_alone(server, engine):
    url, app = server
    bodies = [{"model": engine.loaded.name, "messages": messages(i), "temperature": 0,
               "max_tokens": 24 + 6 * i, "stream": i % 2 == 1} for i in range(len(QUESTIONS))]
    alone = [engine.generate(render_chat(engine.tokenizer, messages(i)), chunks=DOCS,
                             config=GenerationConfig(max_new_tokens=b["max_tokens"])).text
             for i, b in enumerate(bodies)]
    assert len(set(alone)) == len(alone)  # different prompts, different answers

    results: list = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = answer(url, bodies[i])
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    steps_before = app.state.scheduler.steps
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [text for text, _ in results] == alone
    stats = [s for _, s in results]
    assert all(s["cache_hits"] == 2 and s["reused_tokens"] > 0 for s in stats)
    assert [s["new_tokens"] for s in stats] == [b["max_tokens"] for b in bodies]
    # they were decoded together: fewer steps than tokens, and batches of more than one
    assert max(s["mean_batch_size"] for s in stats) > 1
    tokens = sum(s["new_tokens"] - 1 for s in stats)  # the first token comes from the prefill
    assert app.state.scheduler.steps - steps_before < tokens

    # and each alone, through the server, once more
    assert [answer(url, body)[0] for body in bodies] == alone


def test_a_stop_string_ends_one_answer_of_the_batch(server, engine):
    url, _ = server
    body = {"model": engine.loaded.name, "messages": messages(0), "temperature": 0,
            "max_tokens": 30}
    full, _ = answer(url, body)
    stop = full[10:12]
    results = {}

    def client(name: str, extra: dict) -> None:
        results[name] = answer(url, {**body, **extra})

    threads = [threading.Thread(target=client, args=("stopped", {"stop": stop})),
               threading.Thread(target=client, args=("whole", {"stream": True}))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results["stopped"][0] == full[:full.index(stop)]
    assert results["whole"][0] == full


# ---- naive mode ------------------------------------------------------------------------------
def test_naive_mode_reuses_nothing_and_answers_as_a_full_prefill(server, engine):
    url, _ = server
    prompt = render_chat(engine.tokenizer, messages(2))
    config = GenerationConfig(max_new_tokens=12)
    body = {"model": engine.loaded.name, "messages": messages(2), "temperature": 0,
            "max_tokens": 12}
    turbo_text, turbo = answer(url, body)
    assert turbo["mode"] == "turbo" and turbo["reused_tokens"] > 0 and turbo["cache_hits"] == 2
    assert turbo_text == engine.generate(prompt, chunks=DOCS, config=config).text

    naive_text, naive = answer(url, {**body, "turborag_mode": "naive"})  # per request
    full = engine.generate(prompt, config=config, mode="naive")
    assert naive["mode"] == "naive" and naive["reused_tokens"] == naive["cache_hits"] == 0
    assert naive["prefilled_tokens"] == naive["prompt_tokens"] == turbo["prompt_tokens"]
    assert naive_text == full.text

    with running(create_app(engine, mode="naive")) as naive_url:  # the whole server
        assert httpx.get(f"{naive_url}/health").json()["mode"] == "naive"
        text, stats = answer(naive_url, {**body, "stream": True})
        assert stats["mode"] == "naive" and stats["reused_tokens"] == 0
        assert text == full.text
        # this app has indexed nothing: the request names its chunks
        text, stats = answer(naive_url, {**body, "turborag_mode": "turbo",
                                         "turborag_chunks": DOCS})
        assert stats["reused_tokens"] == turbo["reused_tokens"] and text == turbo_text


def test_an_unknown_mode_is_refused(server, engine):
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": engine.loaded.name, "messages": messages(0), "turborag_mode": "fast"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "turborag_mode"
    with pytest.raises(ValueError, match="mode"):
        create_app(engine, mode="fast")
    with pytest.raises(ValueError, match="max_batch"):
        create_app(engine, max_batch=0)


# ---- recovery --------------------------------------------------------------------------------
def test_the_recovery_field_reaches_the_prefill_and_a_bad_one_is_a_400(server, engine):
    """turborag_recovery over a real socket: each request's recovery is the one it asked for
    (the answer is the engine's own with that recovery), the server's default without one,
    and a spec that does not parse is refused before any compute, naming the spellings."""
    url, _ = server
    prompt = render_chat(engine.tokenizer, messages(1))
    config = GenerationConfig(max_new_tokens=12)
    body = {"model": engine.loaded.name, "messages": messages(1), "temperature": 0,
            "max_tokens": 12}
    seen = {}
    for spec in ("none", "boundary:3", "select:1"):
        text, stats = answer(url, {**body, "turborag_recovery": spec, "stream": spec == "none"})
        own = engine.generate(prompt, chunks=DOCS[1:3], config=config, recovery=spec)
        assert stats["recovery"] == spec and text == own.text
        assert stats["recomputed_tokens"] == own.stats.extra["recomputed_tokens"]
        seen[spec] = stats
    assert seen["none"]["recomputed_tokens"] == 0
    # three of each of the two chunks, and of the stitched separator between them
    assert 3 * 2 <= seen["boundary:3"]["recomputed_tokens"] <= 3 * 3
    # every chunk token recomputed: only the exact prompt head is still reused
    everything = seen["select:1"]["recomputed_tokens"]
    assert everything == seen["none"]["reused_tokens"] - seen["select:1"]["reused_tokens"] > 0
    _, default = answer(url, body)
    assert default["recovery"] == str(engine.recovery) == str(parse_recovery(DEFAULT_RECOVERY))
    for bad in ("select:2", "select", "fancy:3"):
        r = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                       json={**body, "turborag_recovery": bad})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "turborag_recovery"
        assert "select:RATIO" in error["message"] and "boundary:K" in error["message"]
