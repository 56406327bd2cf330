"""The ingestion request both ends share (vllm/ingest.py), without vLLM: the prompt a client
builds is what ChunkEncoder prefills, the scheduler's checks, and the HTTP client against a
stand-in server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.conftest import tiny_model
from turborag_integrations.core.errors import EmptyChunkError
from turborag_integrations.core.kv.blob import fingerprint_model
from turborag_integrations.core.prefill.anchor import anchor_ids
from turborag_integrations.core.prefill.chunk_encoder import ChunkEncoder
from turborag_integrations.vllm.ingest import (IngestPlan, IngestRequestError, chunk_prompt,
                                               ingest, ingest_params, plan_ingest,
                                               wants_ingest)

TEXT = "The ferry Aldine sank in 1932 with no loss of life.\n"


@pytest.fixture(scope="module")
def encoder():
    loaded = tiny_model("llama")
    fp = fingerprint_model(loaded.model, loaded.tokenizer, loaded.name)
    return ChunkEncoder(loaded.model, loaded.tokenizer, fp,
                        anchor_ids=anchor_ids("chat", loaded.tokenizer))


def test_the_prompt_is_what_chunk_encoder_prefills(encoder):
    ids = chunk_prompt(encoder.tokenizer, TEXT, "chat")
    assert ids == encoder.anchor_ids + encoder.tokenize(TEXT)
    assert chunk_prompt(encoder.tokenizer, TEXT, "none") == encoder.tokenize(TEXT)
    with pytest.raises(EmptyChunkError):
        chunk_prompt(encoder.tokenizer, "  \n")


def test_the_scheduler_plans_the_chunk_after_the_anchor(encoder):
    ids = chunk_prompt(encoder.tokenizer, TEXT)
    plan = plan_ingest(ingest_params("acme", "doc-1"), ids, encoder.anchor_ids,
                       max_chunk_tokens=encoder.max_chunk_tokens)
    assert plan == IngestPlan(tuple(encoder.tokenize(TEXT)), len(encoder.anchor_ids), "acme",
                              "doc-1")
    assert plan.prompt_len == len(ids) and plan.anchor_len == encoder.base_position
    # no anchor: the whole prompt is the chunk, at 0..n-1
    assert plan_ingest(ingest_params(), ids, [], max_chunk_tokens=1000).anchor_len == 0
    assert wants_ingest(ingest_params()) and not wants_ingest({"turborag_chunks": []})
    assert not wants_ingest(None)


@pytest.mark.parametrize("case, message", [
    ("no_anchor", "does not start with the"),
    ("anchor_only", "anchor only"),
    ("too_long", "exceeds"),
    ("salted", "cache_salt"),
    ("bad_namespace", "turborag_namespace"),
    ("bad_doc", "turborag_doc_id"),
])
def test_requests_that_cannot_be_ingested_say_why(encoder, case, message):
    anchor, chunk = encoder.anchor_ids, encoder.tokenize(TEXT)
    params, prompt, salt = ingest_params(), anchor + chunk, None
    if case == "no_anchor":
        prompt = chunk
    elif case == "anchor_only":
        prompt = anchor
    elif case == "too_long":
        prompt = anchor + chunk * 200
    elif case == "salted":
        salt = "turborag:acme"
    elif case == "bad_namespace":
        params["turborag_namespace"] = 7
    else:
        params["turborag_doc_id"] = ["a"]
    with pytest.raises(IngestRequestError, match=message):
        plan_ingest(params, prompt, anchor, max_chunk_tokens=500, salt=salt)


class StandIn(BaseHTTPRequestHandler):
    """vLLM's completions endpoint as the connector answers it: the chunk's key, or a refusal."""

    bodies: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StandIn.bodies.append((self.path, body))
        if len(body["prompt"]) > 100:
            reply, code = {"error": {"message": "prompt too long"}}, 400
        else:
            lead = body["kv_transfer_params"].get("turborag_head_len", 0)  # another encoding
            key = f"k{lead}:" + "-".join(map(str, body["prompt"][-3:]))
            reply, code = {"kv_transfer_params": {"turborag": {"ingest": {
                "key": key, "stored": True, "existing": body["prompt"][-1] == 0}}}}, 200
        data = json.dumps(reply).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_client_sends_one_request_per_chunk_and_reports(encoder):
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    StandIn.bodies = []
    try:
        texts = [TEXT, "A second chunk of text.\n", "x " * 200, TEXT]
        report = ingest(texts, url=f"http://127.0.0.1:{server.server_port}", model="m",
                        tokenizer=encoder.tokenizer, namespace="acme",
                        doc_ids=["d1", "d2", "d3", "d1"], concurrency=2)
    finally:
        server.shutdown()
    assert len(StandIn.bodies) == 3  # the repeated chunk of d1 is sent once
    assert report.stored == 2 and report.existing == 0
    assert report.keys[0] and report.keys[1] and report.keys[2] is None
    assert report.keys[3] == report.keys[0]
    assert "HTTP 400" in report.errors[2] and "prompt too long" in report.errors[2]
    path, body = next(b for b in StandIn.bodies if b[1]["kv_transfer_params"].get(
        "turborag_doc_id") == "d1")
    assert path == "/v1/completions" and body["max_tokens"] == 1 and body["model"] == "m"
    assert body["prompt"] == chunk_prompt(encoder.tokenizer, TEXT)
    assert body["kv_transfer_params"] == {"turborag_ingest": True, "turborag_namespace": "acme",
                                          "turborag_doc_id": "d1"}


def test_the_client_raises_when_no_server_answers(encoder):
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    port = server.server_port
    server.server_close()
    with pytest.raises(ConnectionError, match="no server"):
        ingest([TEXT], url=f"http://127.0.0.1:{port}/v1", model="m", tokenizer=encoder.tokenizer)
    with pytest.raises(EmptyChunkError):  # before anything is sent
        ingest([TEXT, ""], url=f"http://127.0.0.1:{port}", model="m", tokenizer=encoder.tokenizer)


def test_a_chunk_after_its_context_is_planned_as_chunk_encoder_encodes_it(encoder):
    """With the connector's context_tokens, the prompt is anchor + context + chunk; the plan
    drops anchor and context, and its base_position is the blob ChunkEncoder makes."""
    from turborag_integrations.core.prefill.context import context_token_ids

    before = "The ferry Aldine was built in Cardiff in 1901 for the island service."
    context = context_token_ids(encoder.tokenizer, before, 16)
    assert len(context) == 16
    prompt = encoder.anchor_ids + context + encoder.tokenize(TEXT)
    plan = plan_ingest(ingest_params(context_len=16), prompt, encoder.anchor_ids,
                       max_chunk_tokens=encoder.max_chunk_tokens, context_tokens=32)
    assert plan.chunk_ids == tuple(encoder.tokenize(TEXT))
    assert plan.anchor_len == len(encoder.anchor_ids) + 16
    ctx_encoder = ChunkEncoder(encoder.model, encoder.tokenizer, encoder.fingerprint,
                               anchor_ids=encoder.anchor_ids, context_tokens=16)
    assert ctx_encoder.context_ids(before) == context
    [blob] = ctx_encoder.encode_many([TEXT], contexts=[before])
    assert blob.base_position == plan.anchor_len
    for params, context_tokens, message in (
            (ingest_params(context_len=16), 8, "at most 8 context tokens"),
            (ingest_params(context_len=16), 0, "at most 0 context tokens"),
            ({"turborag_ingest": True, "turborag_context_len": -1}, 32, "whole number"),
            ({"turborag_ingest": True, "turborag_context_len": "16"}, 32, "whole number")):
        with pytest.raises(IngestRequestError, match=message):
            plan_ingest(params, prompt, encoder.anchor_ids,
                        max_chunk_tokens=encoder.max_chunk_tokens,
                        context_tokens=context_tokens)
    with pytest.raises(IngestRequestError, match="after 16 context tokens exceeds"):
        plan_ingest(ingest_params(context_len=16), prompt, encoder.anchor_ids,
                    max_chunk_tokens=len(encoder.tokenize(TEXT)) + 8, context_tokens=32)


def test_the_client_sends_each_chunk_after_its_context(encoder):
    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    StandIn.bodies = []
    before = "Ferries of the island service, 1901 to 1932."
    try:
        ingest([TEXT, "Short."], url=f"http://127.0.0.1:{server.server_port}", model="m",
               tokenizer=encoder.tokenizer, contexts=[before, None], context_tokens=12)
    finally:
        server.shutdown()
    bodies = {len(b["prompt"]): b for _, b in StandIn.bodies}
    with_context = max(bodies.values(), key=lambda b: len(b["prompt"]))
    context = encoder.tokenizer(before + "\n\n", add_special_tokens=False)["input_ids"][-12:]
    assert with_context["prompt"] == encoder.anchor_ids + context + encoder.tokenize(TEXT)
    assert with_context["kv_transfer_params"]["turborag_context_len"] == 12
    alone = min(bodies.values(), key=lambda b: len(b["prompt"]))
    assert "turborag_context_len" not in alone["kv_transfer_params"]


HEAD = "<s>system\nAnswer from the context.</s>\n<s>user\nContext:\n"


def test_a_lead_blob_is_planned_as_the_engine_encodes_it(encoder, tmp_path):
    """head + chunk with turborag_head_len: the plan drops the head and keys the chunk under
    the head's lead encoding — the key, fingerprint and base position of the lead blob an
    engine told that head stores."""
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.library import head_ids

    head = head_ids(encoder.tokenizer, HEAD)
    chunk = encoder.tokenize(TEXT)
    plan = plan_ingest(ingest_params(namespace="acme", head_len=len(head)), head + chunk,
                       encoder.anchor_ids, max_chunk_tokens=encoder.max_chunk_tokens)
    assert plan.chunk_ids == tuple(chunk) and plan.anchor_len == len(head)
    assert plan.namespace == "acme" and plan.lead
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", encoder=None,
                            prompt_heads=[HEAD], progress=False)
    engine.encode_chunks([TEXT])
    [lead] = [engine.store.get(k) for k in engine.store.keys()
              if engine.library.is_lead(engine.store.get(k))]
    assert lead.fingerprint.encoding == plan.lead and lead.base_position == plan.anchor_len
    assert engine.store.key(engine.fingerprint.with_encoding(plan.lead), chunk) == lead.key
    for params, prompt, message in (
            ({"turborag_ingest": True, "turborag_head_len": 0}, head + chunk, "positive"),
            ({"turborag_ingest": True, "turborag_head_len": True}, head + chunk, "positive"),
            (ingest_params(context_len=4, head_len=len(head)), head + chunk, "not both"),
            (ingest_params(head_len=len(head)), head, "head only")):
        with pytest.raises(IngestRequestError, match=message):
            plan_ingest(params, prompt, encoder.anchor_ids,
                        max_chunk_tokens=encoder.max_chunk_tokens, context_tokens=32)
    with pytest.raises(IngestRequestError, match="split the chunk"):
        plan_ingest(ingest_params(head_len=len(head)), head + chunk, encoder.anchor_ids,
                    max_chunk_tokens=len(head) + len(chunk) - 1)


def test_the_client_sends_each_chunk_after_each_head(encoder):
    from turborag_integrations.core.library import head_ids

    server = ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    StandIn.bodies = []
    texts, head_text = ["The Aldine sank.\n", "It had two masts.\n", "The Aldine sank.\n"], "Q&A:\n"
    try:
        report = ingest(texts, url=f"http://127.0.0.1:{server.server_port}", model="m",
                        tokenizer=encoder.tokenizer, heads=[head_text])
        with pytest.raises(ValueError, match="prompt head 0 is empty"):
            ingest([TEXT], url=f"http://127.0.0.1:{server.server_port}", model="m",
                   tokenizer=encoder.tokenizer, heads=[""])
    finally:
        server.shutdown()
    assert len(StandIn.bodies) == 4  # two distinct chunks, each alone and after the head
    head = head_ids(encoder.tokenizer, head_text)
    leads = [b for _, b in StandIn.bodies if "turborag_head_len" in b["kv_transfer_params"]]
    assert sorted(b["prompt"] for b in leads) == sorted(
        head + encoder.tokenize(t) for t in texts[:2])
    assert all(b["kv_transfer_params"]["turborag_head_len"] == len(head) for b in leads)
    assert report.stored == 2 and report.lead_stored == 2 and not report.lead_errors
    assert report.lead_keys[0][0] == report.lead_keys[0][2] != report.keys[0]
