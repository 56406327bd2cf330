"""`turborag serve --prompt`: the clients' template named to the server gives every ingested
chunk a lead blob, and a request built from that template stitches its first chunk from it,
exactly as its full prefill computes it."""

import json

import pytest
from fastapi.testclient import TestClient

from turborag_integrations.core.prompt_template import (read_prompt_template,
                                                        render_prompt_template)
from turborag_integrations.server.app import create_app

from .conftest import DOCS, make_engine

TEMPLATE = [{"role": "system", "content": "Answer using only the context."},
            {"role": "user", "content": "Context:\n{context}\n\nQuestion: {question}"}]


def filled(docs, question="How high is the Tall Widow lighthouse?"):
    return [{**m, "content": m["content"].format(context="\n\n".join(docs), question=question)}
            for m in TEMPLATE]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("heads")
    (folder / "rag.json").write_text(json.dumps(TEMPLATE))
    engine = make_engine(folder)
    engine.add_prompt(render_prompt_template(read_prompt_template(folder / "rag.json"),
                                             engine.tokenizer))
    with TestClient(create_app(engine)) as client:
        r = client.post("/v1/turborag/chunks", json={"texts": DOCS})
        assert r.status_code == 200, r.text
        yield client, engine


def ask(client, engine, messages, **params):
    r = client.post("/v1/chat/completions", json={
        "model": engine.loaded.name, "messages": messages, "temperature": 0, "max_tokens": 8,
        **params})
    assert r.status_code == 200, r.text
    return r.json()


def test_ingestion_encodes_a_lead_blob_per_chunk(served):
    _, engine = served
    assert len(engine.library.prompt_heads) == 1
    leads = [k for k in engine.store.keys() if engine.library.is_lead(engine.store.get(k))]
    assert len(leads) == len(DOCS)


def test_a_request_from_the_template_stitches_its_first_chunk_exactly(served):
    client, engine = served
    one = ask(client, engine, filled(DOCS[:1]))
    assert one["turborag"]["lead_blob"] is True and one["turborag"]["cache_hits"] == 1
    # one chunk after the known head: the whole stitched prompt is the full prefill's
    full = ask(client, engine, filled(DOCS[:1]), turborag_mode="naive")
    assert one["choices"][0]["message"]["content"] == full["choices"][0]["message"]["content"]
    two = ask(client, engine, filled(DOCS[1:]))
    assert two["turborag"]["lead_blob"] is True and two["turborag"]["cache_hits"] == 2


def test_a_request_from_another_template_uses_the_usual_blobs(served):
    client, engine = served
    other = [{"role": "user", "content": "Read this first:\n" + DOCS[0] + "\n\nHow high?"}]
    body = ask(client, engine, other)
    assert body["turborag"]["cache_hits"] == 1 and "lead_blob" not in body["turborag"]
