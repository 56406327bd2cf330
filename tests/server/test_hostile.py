"""Hostile input: every malformed, extreme or abusive request gets an OpenAI-style error (or a
correct answer), never a 500 or a hang, and the server answers the next well-formed request.

In process for the bodies; on a live socket for clients that dribble their body (slow loris),
or send a request and vanish."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from turborag_integrations.server.app import create_app

from .conftest import DOCS, running

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine, body_timeout_s=2.0)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def ok_after(client, engine) -> None:
    """A well-formed request right after: answered."""
    r = client.post("/v1/chat/completions", json={"model": engine.loaded.name, "messages": HI,
                                                  "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


def error_of(r, status: int | tuple = 400) -> dict:
    assert r.status_code in ((status,) if isinstance(status, int) else status), r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def post_bytes(client, path: str, raw: bytes):
    return client.post(path, content=raw, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("raw", [
    b"", b"{", b'{"model": "m", "messages": [', b"[]", b"null", b'"text"', b"42",
    b'{"model": "m", "messages": [{"role": "user", "content": "Hi"}]',  # truncated
    b'\xff\xfe{"model": 1}',  # not UTF-8
    b'{"model": "m", "messages": [{"role": "user", "content": "\xc3\x28"}]}',  # bad UTF-8 inside
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions",
                                  "/v1/turborag/chunks"])
def test_malformed_bodies(client, engine, path, raw):
    error_of(post_bytes(client, path, raw), (400, 422))
    ok_after(client, engine)


WRONG_TYPES = {
    "model": 5, "messages": "Hi", "stream": "yes please", "max_tokens": "ten",
    "max_completion_tokens": -3, "temperature": "hot", "top_p": [1], "seed": "x", "stop": 5,
    "n": "two", "presence_penalty": {}, "frequency_penalty": "x", "logit_bias": [1],
    "user": 5, "ignore_eos": "x", "turborag_chunks": "a chunk", "turborag_mode": "fast",
    "cache_salt": 7, "stream_options": "x", "response_format": 5, "tools": "x",
}


@pytest.mark.parametrize("field", sorted(WRONG_TYPES))
def test_a_wrong_type_in_every_field_is_a_400_naming_it(client, engine, field):
    body = {"model": engine.loaded.name, "messages": HI, "max_tokens": 2,
            field: WRONG_TYPES[field]}
    error = error_of(client.post("/v1/chat/completions", json=body))
    assert error["param"] is None or error["param"].split("[")[0].split(".")[0] == field, error
    ok_after(client, engine)


@pytest.mark.parametrize("extra,status", [
    ({"max_tokens": 10**30}, 200), ({"max_tokens": 2**63}, 200), ({"max_tokens": 0}, 400),
    ({"n": 2}, 400), ({"n": 0}, 400), ({"temperature": -1}, 400), ({"temperature": 2.5}, 400),
    ({"top_p": 0}, 400), ({"seed": 2**80}, (200, 400)), ({"stop": ["x"] * 10000}, (200, 400)),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, 400),
    ({"messages": []}, 400), ({"messages": [{"role": "user"}]}, (200, 400)),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ({"model": "x" * 100000}, 404),
])
def test_extreme_values(client, engine, extra, status):
    body = {"model": engine.loaded.name, "messages": HI, "max_tokens": 2, **extra}
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code != 200:
        error_of(r, status)
        assert "x" * 1000 not in r.text  # errors do not echo what they were sent at length
    else:
        assert 200 in ((status,) if isinstance(status, int) else status)
    ok_after(client, engine)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_non_finite_temperatures(client, engine, literal):
    raw = (b'{"model": "' + engine.loaded.name.encode() + b'", "max_tokens": 2, '
           b'"messages": [{"role": "user", "content": "Hi"}], "temperature": ' + literal + b"}")
    error = error_of(post_bytes(client, "/v1/chat/completions", raw))
    assert error["param"] in ("temperature", None)
    ok_after(client, engine)


def test_control_characters_are_answered(client, engine):
    content = "".join(chr(c) for c in range(32)) + "\u2028\u2029\ufeff\U0010ffff" + "Hi"
    r = client.post("/v1/chat/completions", json={
        "model": engine.loaded.name, "max_tokens": 2,
        "messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    lone = b'{"model": "' + engine.loaded.name.encode() + \
        b'", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800 lone"}]}'
    error = error_of(post_bytes(client, "/v1/chat/completions", lone))
    assert error["param"] == "messages[0].content" and "surrogate" in error["message"]
    ok_after(client, engine)


def test_ten_thousand_messages(client, engine):
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "Hi there."}
                for i in range(10000)]
    error = error_of(client.post("/v1/chat/completions", json={
        "model": engine.loaded.name, "messages": messages, "max_tokens": 2}), (400, 413))
    assert "context window" in error["message"] or error["code"] == "request_too_large"
    ok_after(client, engine)


def test_a_prompt_over_the_window(client, engine):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "word " * 5000}]}),
                       ("/v1/completions", {"prompt": "word " * 5000})):
        error = error_of(client.post(path, json={"model": engine.loaded.name, "max_tokens": 2,
                                                 **body}))
        assert "context window" in error["message"]
    ok_after(client, engine)


def test_chunk_texts_under_the_minimum_are_stored_not_indexed(client, engine):
    r = client.post("/v1/turborag/chunks", json={"texts": ["tiny", "a", "é"]})
    assert r.status_code == 200, r.text
    assert r.json()["indexed"] == 0
    error_of(client.post("/v1/turborag/chunks", json={"texts": ["   "]}))
    error_of(client.post("/v1/turborag/chunks", json={"texts": []}))
    error_of(client.post("/v1/turborag/chunks", json={"texts": ["x" * 40], "surprise": 1}))
    ok_after(client, engine)


def test_a_zero_width_space_never_matches_the_clean_twin(client, engine):
    """Chunks are matched verbatim: a text that differs by an invisible character (or by its
    unicode normal form) is another text, and is prefilled."""
    twin = DOCS[2].replace("ceramic", "cer\u200bamic")
    nfd = "Cafe\u0301 Orbital serves the kiln workers breakfast from six in the morning."
    r = client.post("/v1/turborag/chunks", json={"texts": [twin, nfd]})
    assert r.status_code == 200 and r.json()["indexed"] == 2
    for text, hits in ((DOCS[2], 0), (twin, 1), ("Caf\u00e9" + nfd[5:], 0), (nfd, 1)):
        r = client.post("/v1/chat/completions", json={
            "model": engine.loaded.name, "max_tokens": 2,
            "messages": [{"role": "user", "content": f"Context:\n{text}\n\nQuestion: what?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["turborag"]["cache_hits"] == hits, text
    ok_after(client, engine)


# ---- on a live socket --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(app):
    with running(app) as url:
        yield url


def raw_request(url: str, head_length: int, body: bytes) -> socket.socket:
    address = urlsplit(url)
    sock = socket.create_connection((address.hostname, address.port), timeout=30)
    sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {head_length}\r\n\r\n"
                  ).encode() + body)
    return sock


def test_a_slow_loris_body_times_out_and_others_are_answered(live, engine):
    body = json.dumps({"model": engine.loaded.name, "messages": HI, "max_tokens": 2}).encode()
    sock = raw_request(live, len(body), body[:5])
    started = time.monotonic()
    with httpx.Client(base_url=live, timeout=30) as http:
        r = http.post("/v1/chat/completions", json={"model": engine.loaded.name,
                                                    "messages": HI, "max_tokens": 2})
        assert r.status_code == 200  # the dribbling client holds nothing up
        try:  # a byte every 0.4 s: never done within the body timeout (2 s here)
            for byte in body[5:]:
                sock.sendall(bytes([byte]))
                time.sleep(0.4)
        except OSError:  # the server answered and closed the connection
            pass
        reply = sock.recv(4096).decode(errors="replace")
        assert reply.startswith("HTTP/1.1 408"), reply[:200]
        assert "request_timeout" in reply
        assert time.monotonic() - started < 15
        sock.close()
        assert http.get("/health").status_code == 200


def server_errors(http) -> int:
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in http.get("/metrics").text.split("\n")
               if line.startswith("turborag_requests_total") and 'status="500"' in line)


def test_a_client_that_sends_then_vanishes(live, engine):
    body = json.dumps({"model": engine.loaded.name, "messages": HI, "max_tokens": 200,
                       "stream": True}).encode()
    with httpx.Client(base_url=live, timeout=60) as http:
        before = server_errors(http)
    for _ in range(3):
        raw_request(live, len(body), body).close()
    truncated = raw_request(live, len(body), body[:len(body) // 2])
    truncated.close()
    with httpx.Client(base_url=live, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={"model": engine.loaded.name,
                                                    "messages": HI, "max_tokens": 2})
        assert r.status_code == 200
        assert server_errors(http) == before == 0
