"""Clients that leave a live server: a client that leaves mid-stream cancels its generation and
frees its place in the batch at once; one that leaves while queued never reaches the model; and
no request holds a thread of its own while it waits.

The server here decodes one request at a time (max_batch=1), so that the next request can only
start once the place is free."""

import logging
import re
import threading

import httpx
import pytest

from turborag_integrations.server.app import create_app

from .conftest import first_chunk, post_raw, running, wait_until

LONG = 1500  # tokens: seconds of decoding; the answers never end early (conftest.make_engine)


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine, max_batch=1)


@pytest.fixture(scope="module")
def base_url(app):
    with running(app) as url:
        yield url


def long_answer(engine, question: str) -> dict:
    return {"model": engine.loaded.name, "stream": True, "max_tokens": LONG,
            "messages": [{"role": "user", "content": question}]}


def generations(caplog) -> list[tuple[str, int]]:
    """(finish reason, tokens) of each generation the server logged, in order."""
    found = []
    for record in caplog.records:
        m = re.match(r"chatcmpl-\w+: (\w+) after (\d+) tokens", record.getMessage())
        if record.name == "turborag.server" and m:
            found.append((m[1], int(m[2])))
    return found


def short_answer(base_url: str, engine) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=120) as http:
        return http.post("/v1/chat/completions", json={
            "model": engine.loaded.name, "max_tokens": 3,
            "messages": [{"role": "user", "content": "And now?"}]})


def test_a_client_that_leaves_mid_stream_cancels_its_generation(app, base_url, engine, caplog):
    caplog.set_level(logging.INFO, logger="turborag.server")
    first = post_raw(base_url, long_answer(engine, "Tell me everything."))
    first_chunk(first)
    first.close()
    scheduler = app.state.scheduler
    wait_until(lambda: scheduler.in_flight == 0, "the place in the batch to be free", timeout=5)

    r = short_answer(base_url, engine)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    wait_until(lambda: len(generations(caplog)) == 2, "both generations")
    (reason, tokens), second = generations(caplog)
    assert reason == "cancelled" and tokens < LONG
    assert second == ("length", 3)


def test_a_client_that_leaves_while_queued_never_reaches_the_engine(base_url, engine, caplog,
                                                                    decoding_gate):
    caplog.set_level(logging.INFO, logger="turborag.server")
    health = lambda: httpx.get(f"{base_url}/health").json()  # noqa: E731
    first = post_raw(base_url, long_answer(engine, "Tell me everything."))
    first_chunk(first)
    decoding_gate.clear()  # the first holds the one place until it leaves
    queued = post_raw(base_url, long_answer(engine, "And then some more."))
    wait_until(lambda: health()["queue_depth"] == 1, "the second request to queue")
    queued.close()
    # the server sees it go (and answers 499) while the first still holds the one place
    wait_until(lambda: health()["queue_depth"] == 0, "the server to notice", timeout=5)
    assert health()["in_flight"] == 1
    first.close()
    decoding_gate.set()

    assert short_answer(base_url, engine).status_code == 200
    wait_until(lambda: len(generations(caplog)) == 2, "both generations")
    assert [reason for reason, _ in generations(caplog)] == ["cancelled", "length"]
    assert health()["queue_depth"] == 0
    metrics = httpx.get(f"{base_url}/metrics").text
    assert 'turborag_requests_total{endpoint="/v1/chat/completions",status="499"} 1' in metrics


def test_no_thread_waits_per_request(app, base_url, engine, decoding_gate):
    """Six requests in flight (one decoding, five queued) start no thread: the scheduler's worker
    decodes, the event loop turns tokens into text and watches the connections, and chunk
    lookups share a pool of two threads."""
    health = lambda: httpx.get(f"{base_url}/health").json()  # noqa: E731
    assert short_answer(base_url, engine).status_code == 200  # the lookup pool is under way
    before = {thread.ident for thread in threading.enumerate()}
    clients = [post_raw(base_url, long_answer(engine, f"Question {i}?")) for i in range(6)]
    try:
        first_chunk(clients[0])
        decoding_gate.clear()  # the first stays in the batch, the other five in the queue
        wait_until(lambda: health()["queue_depth"] == 5, "the other five to queue")
        started = [t.name for t in threading.enumerate() if t.ident not in before]
    finally:
        for client in clients:
            client.close()
        decoding_gate.set()
    assert len(started) <= 1 and all(name.startswith("turborag-lookup") for name in started), \
        started
    scheduler = app.state.scheduler
    wait_until(lambda: scheduler.in_flight == 0 and health()["queue_depth"] == 0,
               "every request to leave", timeout=10)
