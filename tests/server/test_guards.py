"""What a request must pass: the API key (401), the size of its body (413, refused before it is
read) and a place in the queue (429 with Retry-After), each answered in OpenAI's error shape."""

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from turborag_integrations.server.app import create_app

from .conftest import running, wait_until
from .test_disconnect import first_chunk, long_answer, post_raw

KEY = "sk-test-0123456789"
HI = [{"role": "user", "content": "Hi"}]


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ---- the API key -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed(engine):
    with TestClient(create_app(engine, api_key=KEY)) as c:
        yield c


def test_every_v1_request_needs_the_key(keyed, engine):
    body = {"model": engine.loaded.name, "messages": HI, "max_tokens": 2}
    missing = error_of(keyed.post("/v1/chat/completions", json=body), 401)
    assert missing["code"] == "invalid_api_key" and "Authorization: Bearer" in missing["message"]
    wrong = keyed.post("/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {KEY}x"})
    assert error_of(wrong, 401)["code"] == "invalid_api_key"
    assert KEY not in wrong.text
    assert wrong.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/v1/nowhere"):  # unknown paths too: nothing is revealed
        error_of(keyed.get(path), 401)
    error_of(keyed.get("/v1/models", headers={"Authorization": KEY}), 401)  # not "Bearer"

    auth = {"Authorization": f"Bearer {KEY}"}
    assert keyed.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
    assert keyed.get("/v1/models", headers=auth).status_code == 200
    # health and metrics stay open, for load balancers and scrapers
    assert keyed.get("/health").json()["status"] == "ok"
    metrics = keyed.get("/metrics").text
    assert 'turborag_requests_total{endpoint="/v1/chat/completions",status="401"} 2' in metrics
    assert 'turborag_requests_total{endpoint="/v1/chat/completions",status="200"} 1' in metrics


def test_chat_openai_passes_the_key(engine):
    pytest.importorskip("langchain_openai")
    import openai
    from langchain_openai import ChatOpenAI

    with running(create_app(engine, api_key=KEY)) as url:
        llm = ChatOpenAI(model=engine.loaded.name, base_url=f"{url}/v1", api_key=KEY,
                         temperature=0, max_tokens=5)
        assert llm.invoke("Hello").content
        assert "".join(chunk.content for chunk in llm.stream("Hello"))
        stranger = ChatOpenAI(model=engine.loaded.name, base_url=f"{url}/v1", api_key="sk-other",
                              max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            stranger.invoke("Hello")


def test_an_empty_key_is_refused(engine):
    with pytest.raises(ValueError, match="empty"):
        create_app(engine, api_key="")


# ---- the body size ---------------------------------------------------------------------------
LIMIT = 4096


@pytest.fixture(scope="module")
def small(engine):
    with TestClient(create_app(engine, max_body_bytes=LIMIT)) as c:
        yield c


def chat_body(engine, padding: str = "") -> bytes:
    """A chat completion's body, made longer by `padding` in a field that is read and ignored."""
    return json.dumps({"model": engine.loaded.name, "max_tokens": 2, "user": padding,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()


def test_a_body_over_the_limit_is_413(small, engine):
    headers = {"Content-Type": "application/json"}
    fits = chat_body(engine, "x" * (LIMIT - len(chat_body(engine))))
    assert len(fits) == LIMIT
    assert small.post("/v1/chat/completions", content=fits, headers=headers).status_code == 200
    error = error_of(small.post("/v1/chat/completions", content=fits + b" ", headers=headers),
                     413)
    assert error["code"] == "request_too_large" and f"{LIMIT:,} bytes" in error["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(LIMIT // 1000 + 1):
            yield b" " * 1000

    r = small.post("/v1/chat/completions", content=chunked(), headers=headers)
    assert "content-length" not in r.request.headers
    assert error_of(r, 413)["code"] == "request_too_large"
    assert error_of(small.post("/v1/chat/completions", content=b"{}",
                               headers={**headers, "Content-Length": "two"}), 400)


def raw_exchange(base_url: str, head: str, body: bytes = b"") -> bytes:
    """Send a request's head (and `body`) on a socket; what the server answers, until it closes
    the connection."""
    address = urlsplit(base_url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(head.encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_live_server_refuses_a_large_body_before_reading_it(engine):
    with running(create_app(engine, max_body_bytes=LIMIT)) as url:
        # Content-Length says 100 MB and no byte of the body is sent: the answer comes anyway.
        answer = raw_exchange(url, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                              "Content-Type: application/json\r\n"
                              f"Content-Length: {100 * 2**20}\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 413 ")
        assert b"request_too_large" in answer
        # A chunked body: refused once more than the limit has arrived, the rest unsent.
        part = b" " * 1000
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for _ in range(LIMIT // 1000 + 1))
        answer = raw_exchange(url, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                              "Content-Type: application/json\r\n"
                              "Transfer-Encoding: chunked\r\n\r\n", chunks)
        assert answer.startswith(b"HTTP/1.1 413 ")
        # the server goes on serving
        r = httpx.post(f"{url}/v1/chat/completions", content=chat_body(engine),
                       headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == 200


# ---- the queue -------------------------------------------------------------------------------
def test_a_request_past_the_queue_limit_is_429_with_retry_after(engine, decoding_gate):
    app = create_app(engine, max_batch=1, max_queue=1)
    gate = decoding_gate
    with running(app) as url:
        health = lambda: httpx.get(f"{url}/health").json()  # noqa: E731
        decoding = post_raw(url, long_answer(engine, "Tell me everything."))
        first_chunk(decoding)  # in the batch: no longer waiting
        gate.clear()  # and there it stays until the gate opens
        queued = post_raw(url, long_answer(engine, "And then some more."))
        wait_until(lambda: health()["queue_depth"] == 1, "the second request to queue")
        try:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
                "model": engine.loaded.name, "messages": HI, "max_tokens": 2})
            error = error_of(r, 429)
            assert r.headers["retry-after"] == "1"
            assert error["code"] == "rate_limit_exceeded" and "at most 1" in error["message"]
            ingest = httpx.post(f"{url}/v1/turborag/chunks", timeout=30,
                                json={"texts": ["A text long enough to be indexed, surely."]})
            error_of(ingest, 429)
        finally:
            queued.close()
            decoding.close()
            gate.set()
        wait_until(lambda: health()["queue_depth"] == health()["in_flight"] == 0,
                   "the server to be idle")
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": engine.loaded.name, "messages": HI, "max_tokens": 2})
        assert r.status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
        assert 'turborag_requests_total{endpoint="/v1/chat/completions",status="429"} 1' in metrics
