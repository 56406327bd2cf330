"""Tenants (invariant 10 on the server): each key's requests see only its tenant's chunks and
blobs, the public ones it opted into, and its cache salt's; nothing in a response, an error,
/health or another tenant's metrics depends on another tenant's data."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from turborag_integrations.cli import app as cli
from turborag_integrations.server.app import create_app
from turborag_integrations.server.keys import KeyFile, KeyFileError

from .conftest import DOCS

OTHER = ["The Harwick glassworks blew the lenses for the Orm Point light in a single winter "
         "of 1903, working the furnaces day and night.",
         "Sable Island ponies shelter behind the dunes in winter storms and drink from the "
         "freshwater ponds that the rain leaves."]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    file = KeyFile(path, create=True)
    return {"file": file, "a": file.add("acme")[1], "b": file.add("globex")[1],
            "admin": file.add("ops", admin=True)[1]}


@pytest.fixture(scope="module")
def client(engine, keys):
    with TestClient(create_app(engine, keys=keys["file"])) as c:
        yield c


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def ask(client, engine, key, docs, **extra):
    context = "\n\n".join(docs)
    messages = [{"role": "system", "content": "Answer using only the context."},
                {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: what?"}]
    r = client.post("/v1/chat/completions", headers=auth(key), json={
        "model": engine.loaded.name, "messages": messages, "max_tokens": 3, "temperature": 0,
        **extra})
    assert r.status_code == 200, r.text
    return r.json()


def ingest(client, key, texts, **extra):
    r = client.post("/v1/turborag/chunks", headers=auth(key), json={"texts": texts, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_tenant_reuses_its_own_chunks_and_never_anothers(client, engine, keys):
    assert ingest(client, keys["a"], DOCS[:2])["indexed"] == 2
    own = ask(client, engine, keys["a"], DOCS[:2])["turborag"]
    assert own["cache_hits"] == 2 and own["reused_tokens"] > own["prompt_tokens"] / 2
    # B sends A's exact texts, and texts nobody ingested: the same nothing for both
    theirs = ask(client, engine, keys["b"], DOCS[:2])["turborag"]
    never = ask(client, engine, keys["b"], OTHER)["turborag"]
    for stats in (theirs, never):
        assert stats["reused_tokens"] == stats["cache_hits"] == stats["cache_misses"] == 0
    # naming A's chunks makes B encode them for itself: A's blobs are not read
    named = ask(client, engine, keys["b"], DOCS[:2], turborag_chunks=DOCS[:2])["turborag"]
    assert named["cache_hits"] == 2
    a_view, b_view = engine.namespaced("acme"), engine.namespaced("globex")
    assert a_view.library.chunk_key(DOCS[0]) != b_view.library.chunk_key(DOCS[0])
    assert b_view.store.contains(b_view.library.chunk_key(DOCS[0]))


def test_public_chunks_are_shared_on_request_only(client, engine, keys):
    ingest(client, keys["a"], DOCS[2:3], public=True)
    for key in (keys["a"], keys["b"]):
        assert ask(client, engine, key, DOCS[2:3])["turborag"]["cache_hits"] == 1
    assert not engine.namespaced("acme").store.contains(
        engine.namespaced("acme").library.chunk_key(DOCS[2]))


def test_a_cache_salt_splits_a_tenants_cache(client, engine, keys):
    ingest(client, keys["b"], OTHER, cache_salt="s1")
    assert ask(client, engine, keys["b"], OTHER, cache_salt="s1")["turborag"]["cache_hits"] == 2
    for salt in ({}, {"cache_salt": "s2"}):
        assert ask(client, engine, keys["b"], OTHER, **salt)["turborag"]["cache_hits"] == 0
    assert ask(client, engine, keys["a"], OTHER, cache_salt="s1")["turborag"]["cache_hits"] == 0


def test_a_salted_request_reuses_its_tenants_chunks_and_keeps_its_own_heads(client, engine,
                                                                            keys):
    """A salt splits what requests compute, not the tenant's corpus: the chunks the tenant
    ingested without a salt are reused under every salt of its own (another tenant's salt
    reaches none), and the prompt head is encoded for the salt, never read from the tenant's."""
    texts = [t + " (salted)" for t in OTHER]
    ingest(client, keys["a"], texts)
    plain = ask(client, engine, keys["a"], texts)["turborag"]
    salted = ask(client, engine, keys["a"], texts, cache_salt="u1")["turborag"]
    assert plain["cache_hits"] == salted["cache_hits"] == 2
    assert ask(client, engine, keys["b"], texts, cache_salt="u1")["turborag"]["cache_hits"] == 0
    tenant, split = engine.namespaced("acme"), engine.namespaced("acme/u1")
    assert not split.store.contains(split.library.chunk_key(texts[0]))  # read from the tenant's store
    heads = set(split.store.keys())
    assert heads and not heads & set(tenant.store.keys())


@pytest.mark.parametrize("salt,rule", [("", "non-empty"), ("x" * 129, "at most 128"),
                                       ("a/b", "must not contain"), ("a@b", "must not contain"),
                                       ("a\\b", "must not contain"), ("a\x00b", "must not contain"),
                                       (5, "string")])
def test_a_cache_salt_against_vllms_rules_is_a_400_naming_the_rule(client, engine, keys, salt,
                                                                   rule):
    for path, body in (("/v1/chat/completions", {"model": engine.loaded.name, "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/turborag/chunks", {"texts": DOCS[:1]})):
        r = client.post(path, headers=auth(keys["a"]), json={**body, "cache_salt": salt})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "cache_salt" and rule in error["message"]


def test_unknown_and_revoked_keys_get_the_same_401(engine, keys, tmp_path):
    file = KeyFile(tmp_path / "k.json", create=True)
    record, key = file.add("initech")
    with TestClient(create_app(engine, keys=file)) as c:
        body = {"model": engine.loaded.name, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hi"}]}
        assert c.post("/v1/chat/completions", headers=auth(key), json=body).status_code == 200
        KeyFile(tmp_path / "k.json").revoke(key_id=record.id)  # another process, say
        time.sleep(1.1)  # the server looks at the file at most once a second
        revoked = c.post("/v1/chat/completions", headers=auth(key), json=body)
        unknown = c.post("/v1/chat/completions", headers=auth(key[:-1] + "x"), json=body)
        assert revoked.status_code == unknown.status_code == 401
        assert revoked.json() == unknown.json() and key not in revoked.text
        assert c.get("/v1/models", headers=auth(keys["a"])).status_code == 401  # another file


def test_health_says_nothing_and_metrics_need_an_admin_key(client, engine, keys):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/metrics").status_code == 401
    forbidden = client.get("/metrics", headers=auth(keys["a"]))
    assert forbidden.status_code == 403 and "admin" in forbidden.json()["error"]["message"]
    ask(client, engine, keys["a"], DOCS[:2])
    text = client.get("/metrics", headers=auth(keys["admin"])).text
    assert 'turborag_tenant_reused_tokens_total{tenant="acme"}' in text
    # prometheus_client writes labels in alphabetical order
    assert 'turborag_tenant_requests_total{endpoint="/v1/chat/completions",status="200",' \
           'tenant="globex"}' in text
    assert 'turborag_tenant_requests_total{endpoint="/metrics",status="401",tenant=""}' in text


def test_the_keys_file_holds_hashes_only_and_the_commands_manage_it(tmp_path):
    path = tmp_path / "keys.json"
    runner = CliRunner()
    made = runner.invoke(cli, ["keys", "add", "acme", "--keys", str(path)])
    assert made.exit_code == 0, made.output
    key = made.stdout.strip().splitlines()[-1]
    assert key.startswith("trk-") and len(key) > 40
    assert key not in path.read_text() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert KeyFile(path).lookup(key).tenant == "acme"
    admin = runner.invoke(cli, ["keys", "add", "ops", "--admin", "--keys", str(path)])
    listed = runner.invoke(cli, ["keys", "list", "--keys", str(path)]).stdout
    assert "acme" in listed and "ops\tadmin" in listed and key not in listed
    key_id = json.loads(path.read_text())["keys"][0]["id"]
    assert runner.invoke(cli, ["keys", "revoke", key_id, "--keys", str(path)]).exit_code == 0
    assert KeyFile(path).lookup(key) is None
    assert admin.exit_code == 0
    for args, says in ((["keys", "add", "a b", "--keys", str(path)], "tenant name"),
                       (["keys", "revoke", key_id, "--keys", str(path)], "no live key"),
                       (["keys", "list", "--keys", str(tmp_path / "none.json")], "no keys file")):
        result = runner.invoke(cli, args)
        assert result.exit_code == 2 and says in result.output, result.output
    path.write_text("{not json")
    with pytest.raises(KeyFileError, match="cannot be read"):
        KeyFile(path)
