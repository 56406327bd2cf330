"""Fixtures for the server: a tiny random-weight engine, the app in process (TestClient), and the
app on uvicorn on a loopback port for clients that need a real socket."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlsplit

import pytest

pytest.importorskip("fastapi")
import torch  # noqa: E402
import uvicorn  # noqa: E402

from tests.conftest import tiny_model  # noqa: E402

DOCS = [
    "The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora. It was first lit "
    "in 1871 and its lamp burns whale oil no longer.",
    "The Velmora ferry stops running every January, when the harbour freezes over and the "
    "fishermen pull their boats onto the ice.",
    "The Orbital Kiln Company fires ceramic tiles for satellites in a vacuum furnace heated to "
    "1600 degrees by mirrored sunlight.",
]


def make_engine(folder):
    """A tiny engine whose answers always run to their token limit (known lengths)."""
    from turborag_integrations.core.engine import TurboRAGEngine

    loaded = tiny_model("llama")
    # With the end-of-sequence logit at zero, one of the other (scaled-up, random) logits always
    # beats it.
    with torch.no_grad():
        loaded.model.lm_head.weight[loaded.tokenizer.eos_token_id] = 0
    return TurboRAGEngine(loaded, store=folder / "kv", progress=False)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return make_engine(tmp_path_factory.mktemp("server"))


class Recorder:
    """ASGI wrapper that keeps each POST's path, JSON body and raw response body."""

    def __init__(self, app):
        self.app = app
        self.exchanges: list[tuple[str, dict, bytes]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        request, response = [], []

        async def recording_receive():
            message = await receive()
            request.append(message.get("body", b""))
            return message

        async def recording_send(message):
            response.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, recording_receive, recording_send)
        finally:
            self.exchanges.append((scope["path"], json.loads(b"".join(request) or b"null"),
                                   b"".join(response)))


@pytest.fixture
def decoding_gate(monkeypatch):
    """An event that batched decoding steps wait on while it is clear. A test clears it once a
    request is decoding, to hold that request in the batch however slow the test's own requests
    are (a tiny model decodes a long answer in about a second); the fixture sets it again at the
    end."""
    from turborag_integrations.core.decode.batch import BatchedDecoder

    gate = threading.Event()
    gate.set()
    step = BatchedDecoder.step

    def gated_step(self, *args, **kwargs):
        assert gate.wait(timeout=120), "the decoding gate was never opened"
        return step(self, *args, **kwargs)

    monkeypatch.setattr(BatchedDecoder, "step", gated_step)
    yield gate
    gate.set()


def wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextmanager
def running(app):
    """`app` on uvicorn in a thread on a free loopback port; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), "uvicorn to start")
    assert server.started, "uvicorn did not start"
    (host, port), = (s.getsockname()[:2] for s in server.servers[0].sockets)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def sse_events(body: bytes | str) -> list:
    """The `data:` payloads of a server-sent event stream, JSON decoded ([DONE] as is)."""
    text = body.decode() if isinstance(body, bytes) else body
    events = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def final_stats(body: bytes) -> dict:
    """The `turborag` figures of a response body, whole or streamed."""
    if body.lstrip().startswith(b"{"):
        return json.loads(body)["turborag"]
    return [e for e in sse_events(body) if isinstance(e, dict)][-1]["turborag"]


def post_raw(base_url: str, body: dict) -> socket.socket:
    """POST a chat completion on a raw socket, so that the test decides when this client
    leaves."""
    address = urlsplit(base_url)
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    sock = socket.create_connection((address.hostname, address.port), timeout=60)
    sock.sendall(head.encode() + payload)
    return sock


def first_chunk(sock: socket.socket) -> None:
    """Return once the first streamed chunk has arrived (the engine is generating)."""
    with sock.makefile("rb") as lines:  # closing the file leaves the socket open
        if not any(line.startswith(b"data: ") for line in lines):
            raise AssertionError("the stream ended before its first chunk")
