"""The HTTP contract, in process: OpenAI's bodies and streams, usage, the TurboRAG figures, reuse
of ingested chunks found by content, errors in OpenAI's shape, and the metrics."""

import pytest
from fastapi.testclient import TestClient

from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.server.app import create_app

from .conftest import DOCS, sse_events
from turborag_integrations.core.prompt_template import render_chat

QUESTION = "How high is the Tall Widow lighthouse?"


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine)) as c:
        yield c


@pytest.fixture(scope="module")
def model(engine):
    return engine.loaded.name


@pytest.fixture(scope="module")
def ingested(client):
    r = client.post("/v1/turborag/chunks", json={"texts": DOCS[:2]})
    assert r.status_code == 200, r.text
    assert r.json()["indexed"] == 2 and len(r.json()["keys"]) == 2
    return DOCS[:2]


def rag_messages(docs):
    context = "\n\n".join(docs)
    return [{"role": "system", "content": "Answer using only the context."},
            {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {QUESTION}"}]


def chat(client, model, messages, **params):
    return client.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                     "temperature": 0, **params})


def streamed_text(events) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events
                   if isinstance(e, dict) and e["choices"])


# ---- answers ---------------------------------------------------------------------------------
def test_chat_reuses_ingested_chunks_found_by_content(client, engine, model, ingested):
    messages = rag_messages(ingested)
    r = chat(client, model, messages, max_tokens=12)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == model
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    stats = body["turborag"]
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0
    assert stats["reused_tokens"] >= sum(len(d.encode()) for d in ingested)  # byte tokenizer
    assert stats["chunk_lookup_s"] >= 0

    prompt = render_chat(engine.tokenizer, messages)
    own = engine.generate(prompt, chunks=ingested, config=GenerationConfig(max_new_tokens=12))
    assert choice["message"]["content"] == own.text
    assert body["usage"] == {"prompt_tokens": own.stats.prompt_tokens, "completion_tokens": 12,
                             "total_tokens": own.stats.prompt_tokens + 12,
                             "prompt_tokens_details": {"cached_tokens": stats["reused_tokens"]}}
    assert stats["reused_tokens"] == own.stats.reused_tokens


def test_streaming_gives_the_same_text_and_ends_with_usage_and_figures(client, model, ingested):
    messages = rag_messages(ingested)
    whole = chat(client, model, messages, max_tokens=10).json()
    with client.stream("POST", "/v1/chat/completions", json={
            "model": model, "messages": messages, "temperature": 0, "max_tokens": 10,
            "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.read())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert streamed_text(chunks) == whole["choices"][0]["message"]["content"]
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert last["usage"] == whole["usage"]
    assert last["turborag"]["reused_tokens"] == whole["turborag"]["reused_tokens"] > 0


def test_include_usage_sends_usage_in_a_chunk_of_its_own(client, model):
    r = client.post("/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_events(r.text)[:-1]
    finishing, usage = chunks[-2], chunks[-1]
    assert finishing["choices"][0]["finish_reason"] == "length" and "usage" not in finishing
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert "turborag" in usage


def test_text_completions_whole_and_streamed(client, engine, model, ingested):
    prompt = f"{ingested[0]}\n\nQuestion: {QUESTION}\nAnswer:"
    body = client.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                "temperature": 0, "max_tokens": 8}).json()
    assert body["object"] == "text_completion"
    assert body["turborag"]["cache_hits"] == 1 and body["usage"]["completion_tokens"] == 8
    own = engine.generate(prompt, chunks=ingested, config=GenerationConfig(max_new_tokens=8))
    assert body["choices"][0]["text"] == own.text
    r = client.post("/v1/completions", json={"model": model, "prompt": [prompt],
                                             "temperature": 0, "max_tokens": 8, "stream": True})
    chunks = sse_events(r.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == own.text
    assert chunks[-1]["usage"] == body["usage"]


def test_a_text_completion_defaults_to_16_tokens(client, model):
    body = client.post("/v1/completions", json={"model": model, "prompt": "Once upon"}).json()
    assert body["usage"]["completion_tokens"] == 16


def test_stop_strings_cut_the_answer(client, model, ingested):
    messages = rag_messages(ingested)
    full = chat(client, model, messages, max_tokens=20).json()["choices"][0]["message"]["content"]
    stop = full[5:7]
    for params in ({"stop": stop}, {"stop": [stop, "never appears"]}):
        body = chat(client, model, messages, max_tokens=20, **params).json()
        choice = body["choices"][0]
        assert choice["message"]["content"] == full[:full.index(stop)]
        assert choice["finish_reason"] == "stop"


def test_chunks_named_in_the_request_are_encoded_then_found_by_content(client, model):
    named = DOCS[2]
    messages = rag_messages([named])
    first = chat(client, model, messages, max_tokens=2, turborag_chunks=[named]).json()
    assert first["turborag"]["cache_hits"] == 1 and first["turborag"]["reused_tokens"] > 0
    again = chat(client, model, messages, max_tokens=2).json()  # no field: found by content
    assert again["turborag"]["cache_hits"] == 1


def test_a_prompt_with_no_known_chunk_prefills_everything(client, model):
    body = chat(client, model, [{"role": "user", "content": "Nothing stored is quoted here."}],
                max_tokens=2).json()
    stats = body["turborag"]
    assert stats["cache_hits"] == stats["cache_misses"] == stats["reused_tokens"] == 0
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_chunk_ingested_through_the_engine_registry_is_found(engine, model):
    from turborag_integrations.core.registry import ChunkRegistry

    text = "The lamp of the Tall Widow was converted to electric light in the winter of 1923."
    with TestClient(create_app(engine)) as c:
        before = chat(c, model, rag_messages([text]), max_tokens=2).json()["turborag"]
        engine.encode_chunks([text])
        ChunkRegistry.for_engine(engine).add([text], engine.fingerprint.id)
        after = chat(c, model, rag_messages([text]), max_tokens=2).json()["turborag"]
    assert before["cache_hits"] == 0 and after["cache_hits"] == 1


# ---- errors ----------------------------------------------------------------------------------
def error_of(r, status):
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("params, param", [
    ({"n": 2}, "n"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logprobs": True}, "logprobs"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"42": 3}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "a"}]}, "messages[0]"),
])
def test_unsupported_features_are_400_naming_the_parameter(client, model, params, param):
    body = {"model": model, "messages": HI, **params}
    error = error_of(client.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("params, param", [
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"stop": 5}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
])
def test_invalid_values_are_400_in_openai_shape(client, model, params, param):
    error = error_of(client.post("/v1/chat/completions",
                                 json={"model": model, "messages": HI, **params}), 400)
    assert error["param"] == param


def test_missing_fields_bad_json_and_unknown_models(client, model):
    assert error_of(client.post("/v1/chat/completions", json={"model": model}),
                    400)["message"] == "messages is required"
    error = error_of(client.post("/v1/chat/completions", content=b'{"model": ',
                                 headers={"Content-Type": "application/json"}), 400)
    assert "not valid JSON" in error["message"]
    error = error_of(client.post("/v1/chat/completions",
                                 json={"model": "gpt-4o", "messages": HI}), 404)
    assert error["code"] == "model_not_found" and model in error["message"]
    error_of(client.post("/v1/completions", json={"model": model, "prompt": "a", "echo": True}),
             400)
    error_of(client.post("/v1/completions", json={"model": model, "prompt": ["a", "b"]}), 400)
    error_of(client.post("/v1/completions", json={"model": model, "prompt": [1, 2, 3]}), 400)
    error_of(client.post("/v1/turborag/chunks", json={"texts": ["ok text", "  "]}), 400)
    error_of(client.get("/v1/nowhere"), 404)
    assert error_of(client.get("/v1/chat/completions"), 405)["code"] == "405"


def test_a_prompt_longer_than_the_context_window(client, engine, model):
    long = "word " * (engine.context_window // 4)
    for stream in (False, True):
        error = error_of(client.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": long}], "stream": stream}),
            400)
        assert error["code"] == "context_length_exceeded"
    # the failure freed the engine
    assert chat(client, model, HI, max_tokens=2).status_code == 200


# ---- the rest --------------------------------------------------------------------------------
def test_models_and_health(client, model):
    assert client.get("/v1/models").json()["data"][0]["id"] == model
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["mode"] == "turbo"
    assert health["queue_depth"] == health["in_flight"] == 0
    assert health["max_queue"] == 64 and health["max_batch"] == 8


def test_metrics_in_prometheus_text_format(client, model, ingested):
    chat(client, model, rag_messages(ingested), max_tokens=4)
    client.get("/v1/nowhere")
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.splitlines()
    samples = dict(line.rsplit(" ", 1) for line in lines if not line.startswith("#"))
    assert float(samples['turborag_requests_total{endpoint="/v1/chat/completions",'
                         'status="200"}']) >= 1
    assert float(samples['turborag_requests_total{endpoint="other",status="404"}']) >= 1
    assert float(samples["turborag_requests_in_flight"]) == 1  # this request
    assert float(samples["turborag_queue_depth"]) == float(samples["turborag_batch_size"]) == 0
    # the four-token answer above took three batched steps at least
    assert float(samples["turborag_decode_rows_total"]) >= float(
        samples["turborag_decode_steps_total"]) >= 3
    assert float(samples["turborag_ttft_seconds_count"]) >= 1
    assert samples['turborag_ttft_seconds_bucket{le="+Inf"}'] == samples[
        "turborag_ttft_seconds_count"]
    assert float(samples["turborag_decode_tokens_per_second_count"]) >= 1
    assert 0 < float(samples["turborag_cache_hit_ratio"]) <= 1
    assert float(samples["turborag_reused_tokens_total"]) > 0
    assert float(samples["turborag_indexed_chunks"]) >= 2
    for name in ("turborag_ttft_seconds", "turborag_requests_total", "turborag_queue_depth",
                 "turborag_decode_steps_total"):
        assert any(line.startswith(f"# TYPE {name} ") for line in lines)


def test_ignore_eos_decodes_max_tokens_past_end_of_sequence(client, engine, model, ingested):
    """vLLM's ignore_eos extension: the answer runs to max_tokens, through the token that ends
    it without the field (made an end-of-sequence token for this test)."""
    plain = chat(client, model, rag_messages(ingested), max_tokens=12, ignore_eos=True)
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] == 12
    # a character of the answer that is one token (an ASCII byte: the text may also hold
    # bytes of unfinished UTF-8 sequences, which do not round-trip) becomes end-of-sequence
    text = plain.json()["choices"][0]["message"]["content"]
    char = next(c for c in text[1:] if c.isascii() and c.isprintable())
    token, = engine.tokenizer(char, add_special_tokens=False)["input_ids"]
    saved = engine.eos_ids
    engine.eos_ids = saved | {token}
    try:
        ended = chat(client, model, rag_messages(ingested), max_tokens=12)
        ignored = chat(client, model, rag_messages(ingested), max_tokens=12, ignore_eos=True)
    finally:
        engine.eos_ids = saved
    assert ended.json()["choices"][0]["finish_reason"] == "stop"
    assert ended.json()["usage"]["completion_tokens"] < 12
    assert ignored.json()["choices"][0]["finish_reason"] == "length"
    assert ignored.json()["choices"][0]["message"]["content"] == \
        plain.json()["choices"][0]["message"]["content"]


def test_chunks_are_encoded_after_the_contexts_sent_with_them(tmp_path):
    """POST /v1/turborag/chunks with "contexts": a server whose engine has context_tokens stores
    each chunk as encoded after its context; a count that does not pair up is a 400."""
    from tests.conftest import tiny_model
    from turborag_integrations.core.engine import TurboRAGEngine

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", context_tokens=16,
                            progress=False)
    texts = ["The ferry runs daily from Velmora.", "It stops in January when the harbour freezes."]
    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/turborag/chunks", json={"texts": texts, "contexts": [None, texts[0]]})
        assert r.status_code == 200, r.text
        error = error_of(client.post("/v1/turborag/chunks",
                                     json={"texts": texts, "contexts": [None]}), 400)
        assert "1 contexts for 2 texts" in error["message"]
    enc = engine.library.encoder
    assert engine.library.blob_for(texts[0]).base_position == enc.base_position
    assert engine.library.blob_for(texts[1]).base_position == enc.base_position + 16


def test_a_hot_set_server_indexes_at_ingestion_and_encodes_on_the_kth_use(tmp_path):
    """`turborag serve --admit-after 2`: ingestion only indexes the texts; the second request
    that retrieves them queues their encoding, which /metrics counts; the third reuses them."""
    from turborag_integrations.core.engine import TurboRAGEngine

    from .conftest import make_engine

    base = make_engine(tmp_path)
    engine = TurboRAGEngine(base.loaded, store=base.store, progress=False, admit_after=2)
    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/turborag/chunks", json={"texts": DOCS[:2]})
        assert r.status_code == 200 and r.json()["keys"] == [None, None]
        assert r.json()["indexed"] == 2 and engine.store.stats().writes == 0
        model = engine.loaded.name
        figures = [chat(client, model, rag_messages(DOCS[:2]), max_tokens=2).json()["turborag"]
                   for _ in range(2)]
        assert all(f["cache_misses"] == 2 for f in figures)
        assert engine.admission.drain(30)
        third = chat(client, model, rag_messages(DOCS[:2]), max_tokens=2).json()["turborag"]
        assert third["cache_hits"] == 2
        samples = dict(line.rsplit(" ", 1) for line in client.get("/metrics").text.splitlines()
                       if not line.startswith("#"))
        assert float(samples["turborag_admission_queued_total"]) == 2
        assert float(samples["turborag_admission_encoded_total"]) == 2
        assert float(samples["turborag_admission_pending"]) == 0
    engine.close()
