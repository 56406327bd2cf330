"""The example web app's HTTP contract, and what happens when a client leaves mid-answer.

On a tiny random-weight model over the bundled sample documents: the answers are gibberish,
but the contract, the streaming and the cancellation are the real app's.
"""

import importlib.util
import json
import logging
import re
import socket
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from tests.conftest import tiny_model  # noqa: E402
from turborag_integrations.core.engine import TurboRAGEngine  # noqa: E402
from turborag_integrations.core.settings import GenerationConfig  # noqa: E402
from turborag_integrations.workspace import Workspace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DOCS = ROOT / "turborag_integrations" / "data" / "sample_docs"
QUESTION = "How high is the Tall Widow lighthouse?"
BASE = "http://127.0.0.1:8000"
LONG_ANSWER = 1500  # tokens: seconds of decoding, and with k=1 the prompt still fits 2048


def load_webapp():
    spec = importlib.util.spec_from_file_location("webapp_app",
                                                  ROOT / "examples" / "webapp" / "app.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


webapp = load_webapp()


def parse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in fields:
            events.append((fields["event"], json.loads(fields["data"])))
    return events


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ws")
    loaded = tiny_model("llama")
    # With the end-of-sequence logit at zero the largest of the other (scaled-up, random)
    # logits always beats it: every answer runs to max_new_tokens, so its length is known.
    with torch.no_grad():
        loaded.model.lm_head.weight[loaded.tokenizer.eos_token_id] = 0
    engine = TurboRAGEngine(loaded, store=root / "kv", progress=False)
    ws = Workspace(root, engine=engine, chunk_tokens=160)
    ws.ingest([SAMPLE_DOCS])
    return ws


@pytest.fixture(scope="module")
def client(workspace):
    with TestClient(webapp.create_app(workspace, max_new_tokens=8), base_url=BASE) as c:
        yield c


# ---- the contract ----------------------------------------------------------------------------
def test_get_on_the_work_endpoint_is_405(client):
    r = client.get("/api/ask", params={"q": QUESTION})
    assert r.status_code == 405
    assert "POST" in r.json()["message"]


K_RANGE = "k must be a whole number from 1 to 20"


@pytest.mark.parametrize("body, message", [
    ({"question": QUESTION, "k": 0}, K_RANGE),
    ({"question": QUESTION, "k": 21}, K_RANGE),
    ({"question": QUESTION, "k": "4"}, K_RANGE),
    ({"question": QUESTION, "k": 2.5}, K_RANGE),
    ({"question": QUESTION, "k": True}, K_RANGE),
    ({"question": ""}, "the question is empty"),
    ({"question": " \n\t "}, "the question is empty"),
    ({"question": "x" * 2001}, "the question is longer than 2000 characters"),
    ({"question": 42}, "the question must be a string"),
    ({"question": QUESTION, "compare": "yes"}, "compare must be true or false"),
    ({"question": QUESTION, "compare": 1}, "compare must be true or false"),
    ({"k": 4}, "question is missing"),
    ({"question": QUESTION, "top_k": 3}, "unknown field 'top_k'"),
    (["not", "an", "object"], "must be a JSON object"),
])
def test_bad_input_is_422_with_a_message(client, body, message):
    r = client.post("/api/ask", json=body)
    assert r.status_code == 422
    assert message in r.json()["message"]


def test_a_body_that_is_not_json_is_422(client):
    r = client.post("/api/ask", content=b'{"question": ',
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.json()["message"]
    # a form or text/plain body is what a foreign page can send without asking first
    r = client.post("/api/ask", content=json.dumps({"question": QUESTION}),
                    headers={"Content-Type": "text/plain"})
    assert r.status_code == 422 and "application/json" in r.json()["message"]


@pytest.mark.parametrize("headers, says", [
    ({"Origin": "https://evil.example"}, "other web pages"),
    ({"Origin": "null"}, "other web pages"),  # sandboxed frames, file:// pages
    ({"Origin": "http://localhost:8000"}, "other web pages"),  # another origin on this machine
    ({"Origin": "http://127.0.0.1:9000"}, "other web pages"),
    ({"Host": "evil.example"}, "'evil.example'"),
    # DNS rebinding: the page's own name, pointed at 127.0.0.1, so Origin matches Host
    ({"Host": "evil.example:8000", "Origin": "http://evil.example:8000"}, "'evil.example:8000'"),
])
def test_foreign_origins_and_hosts_are_403(client, headers, says):
    r = client.post("/api/ask", json={"question": QUESTION}, headers=headers)
    assert r.status_code == 403
    assert says in r.json()["message"]


def test_the_page_itself_is_refused_under_a_foreign_host(client):
    assert client.get("/", headers={"Host": "evil.example"}).status_code == 403
    assert client.get("/").status_code == 200


@pytest.mark.parametrize("headers", [
    {},  # curl, scripts: no Origin
    {"Origin": BASE},  # the app's own page
    {"Host": "localhost:8000", "Origin": "http://localhost:8000"},
    {"Host": "[::1]:8000", "Origin": "http://[::1]:8000"},
])
def test_a_good_post_streams_the_answer_then_sources_and_figures(client, headers):
    with client.stream("POST", "/api/ask", json={"question": QUESTION, "k": 2},
                       headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = parse_events(r.read().decode())
    names = [name for name, _ in events]
    assert names[-1] == "done" and set(names[:-1]) == {"delta"}, names
    assert "".join(data["text"] for name, data in events if name == "delta")
    done = events[-1][1]
    assert len(done["sources"]) == 2 and all(s["path"].endswith(".md") for s in done["sources"])
    assert 0 < done["reused_tokens"] <= done["prompt_tokens"]
    assert done["ttft_ms"] > 0 and done["full_prefill_ttft_ms"] > 0
    assert done["finish_reason"] == "length"


def test_the_full_prefills_answer_stands_beside_turborags(client, workspace):
    r = client.post("/api/ask", json={"question": QUESTION, "k": 2})
    events = parse_events(r.text)
    done = events[-1][1]
    answer = workspace.ask(QUESTION, k=2, config=GenerationConfig(max_new_tokens=8))
    for _ in answer:
        pass
    expected = workspace.engine.generate(answer.prompt, mode="naive",
                                         config=GenerationConfig(max_new_tokens=8)).text
    assert done["full_prefill_answer"] == expected != ""


def test_the_page_names_the_model_and_the_documents(client, workspace):
    info = client.get("/api/info").json()
    assert info["model"] == workspace.model_name
    assert sorted(Path(p).name for p in info["documents"]) == sorted(
        p.name for p in SAMPLE_DOCS.glob("*.md"))


def test_compare_false_skips_the_full_prefill(client):
    r = client.post("/api/ask", json={"question": QUESTION, "k": 1, "compare": False})
    done = parse_events(r.text)[-1]
    assert done[0] == "done" and "full_prefill_ttft_ms" not in done[1]


def test_errors_while_answering_arrive_as_failure_events(workspace, tmp_path, monkeypatch):
    empty = Workspace(tmp_path / "empty", engine=workspace.engine)
    with TestClient(webapp.create_app(empty, max_new_tokens=8), base_url=BASE) as c:
        events = parse_events(c.post("/api/ask", json={"question": QUESTION}).text)
        assert events[0][0] == "failure" and "no documents yet" in events[0][1]["message"]

        def broken(*args, **kwargs):
            raise RuntimeError("the index file is gone")

        monkeypatch.setattr(empty, "retrieve", broken)
        for _ in range(2):  # the failure released the model: the next question is answered too
            events = parse_events(c.post("/api/ask", json={"question": QUESTION}).text)
            assert events == [("failure", {"message": "the server failed to answer: "
                                                      "RuntimeError: the index file is gone"})]


# ---- clients that leave ----------------------------------------------------------------------
@pytest.fixture
def live_server(workspace):
    """The app on uvicorn on a loopback port, in a thread; its answers are long."""
    app = webapp.create_app(workspace, compare=False, max_new_tokens=LONG_ANSWER)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                           lifespan="off", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield "127.0.0.1:%d" % server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(30)


def open_stream(address: str, body: dict) -> socket.socket:
    """POST on a raw socket, so that the test decides when this client goes away."""
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    data = json.dumps(body).encode()
    sock.sendall(f"POST /api/ask HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes) -> None:
    received = b""
    while marker not in received:
        chunk = sock.recv(4096)
        assert chunk, f"the server closed the connection before {marker!r}: {received[-500:]!r}"
        received += chunk


def finishes(caplog) -> dict[str, tuple[str, int]]:
    """question -> (finish reason, tokens) from the app's log."""
    found = {}
    for record in caplog.records:
        m = re.match(r"answer to '(.*)': (\w+) after (\d+) tokens", record.getMessage())
        if record.name == "turborag.webapp" and m:
            found[m[1]] = (m[2], int(m[3]))
    return found


def ask_over_http(address: str, question: str) -> list[tuple[str, dict]]:
    with httpx.Client(base_url=f"http://{address}", timeout=120) as http:
        r = http.post("/api/ask", json={"question": question, "k": 1})
    assert r.status_code == 200
    return parse_events(r.text)


def test_a_client_that_leaves_cancels_its_answer_and_frees_the_model(live_server, caplog):
    caplog.set_level(logging.INFO, logger="turborag.webapp")
    first = open_stream(live_server, {"question": QUESTION, "k": 1})
    read_until(first, b"event: delta")
    first.close()

    events = ask_over_http(live_server, "Who runs the Orbital Kiln Company?")
    assert events[-1][0] == "done"
    reason, tokens = finishes(caplog)[QUESTION]
    assert reason == "cancelled" and tokens < LONG_ANSWER


def test_a_client_that_leaves_while_queued_never_reaches_the_model(live_server, caplog):
    caplog.set_level(logging.INFO, logger="turborag.webapp")
    queued_question = "What did the glacier expedition carry?"
    first = open_stream(live_server, {"question": QUESTION, "k": 1})
    read_until(first, b"event: delta")
    second = open_stream(live_server, {"question": queued_question, "k": 1})
    read_until(second, b"event: queued")
    second.close()
    time.sleep(0.5)  # let the server see the second client go before the model is free
    first.close()

    assert ask_over_http(live_server, "Who runs the Orbital Kiln Company?")[-1][0] == "done"
    answered = finishes(caplog)
    assert answered[QUESTION][0] == "cancelled"
    assert queued_question not in answered
