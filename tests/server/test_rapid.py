"""RAPID through the HTTP server (`"turborag_rapid": true`): a greedy answer at η = 0 is the
target's own for the same messages, whole and streamed, with its drafts counted; RAPID and
batched requests sent together all get their answers alone; every request RAPID cannot take
is a 400 that says what to send; a client that leaves stops its answer and gives up its turn;
and stock OpenAI clients ask for it with `extra_body`.

The drafter is the served tiny model itself, reading 64-token chunks its engine retrieves from
the context, and speculates every round (`policy="always"`), so drafts really are verified."""

import json
import logging
import re
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from turborag_integrations.core.rapid import RapidEngine
from turborag_integrations.server.app import create_app
from turborag_integrations.server.keys import KeyFile

from .conftest import DOCS, final_stats, first_chunk, post_raw, running, sse_events, wait_until

CONTEXT = "\n\n".join(DOCS)
SYSTEM = "Answer from the context."
QUESTIONS = ["How high is the lighthouse?", "When does the ferry stop?", "What does the kiln fire?"]
MAX_TOKENS = 24


def messages(question: str = QUESTIONS[0], *, context: str = CONTEXT,
             system: str | None = SYSTEM) -> list[dict]:
    turns = [{"role": "user", "content": f"{context}\n\n{question}"}]
    return ([{"role": "system", "content": system}] if system is not None else []) + turns


@pytest.fixture(scope="module")
def rapid(engine):
    return RapidEngine(engine, policy="always", gamma=4, chunk_tokens=64, threshold=-1.0,
                       compression=1.0)


@pytest.fixture(scope="module")
def client(engine, rapid):
    with TestClient(create_app(engine, rapid=rapid)) as c:
        yield c


@pytest.fixture(scope="module")
def model(engine):
    return engine.loaded.name


def body(model: str, chat: list[dict], **params) -> dict:
    return {"model": model, "messages": chat, "temperature": 0, "max_tokens": MAX_TOKENS,
            **params}


def text_of(response_body: bytes, streamed: bool) -> str:
    if not streamed:
        return json.loads(response_body)["choices"][0]["message"]["content"]
    return "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(response_body)
                   if isinstance(e, dict) and e["choices"])


def naive(client, model: str, chat: list[dict], max_tokens: int = MAX_TOKENS) -> dict:
    """The target alone: the same messages prefilled whole, decoded greedily."""
    r = client.post("/v1/chat/completions", json=body(model, chat, turborag_mode="naive",
                                                      max_tokens=max_tokens))
    assert r.status_code == 200, r.text
    return r.json()


# ---- answers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("system", [SYSTEM, None])
def test_a_rapid_answer_is_the_targets_own_whole_and_streamed(client, model, system):
    chat = messages(system=system)
    alone = naive(client, model, chat)
    whole = client.post("/v1/chat/completions", json=body(model, chat, turborag_rapid=True))
    assert whole.status_code == 200, whole.text
    streamed = client.post("/v1/chat/completions",
                           json=body(model, chat, turborag_rapid=True, stream=True))
    assert streamed.status_code == 200, streamed.text
    assert text_of(whole.content, False) == text_of(streamed.content, True) \
        == alone["choices"][0]["message"]["content"]

    for raw in (whole.content, streamed.content):
        stats = final_stats(raw)
        assert stats["mode"] == "rapid" and stats["gamma"] == 4 and stats["eta"] == 0
        assert stats["policy"]["policy"] == "always" and stats["policy"]["speculated_rounds"] > 0
        assert stats["drafted"] > 0 and 0 < stats["accepted"] <= stats["drafted"]
        assert stats["acceptance_rate"] == stats["accepted"] / stats["drafted"]
        assert stats["drafter_chunks"] > 0 and stats["new_tokens"] == MAX_TOKENS
    usage = whole.json()["usage"]
    assert usage["prompt_tokens"] == alone["usage"]["prompt_tokens"] == \
        final_stats(whole.content)["target_prompt_tokens"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    # the target's prefix cache: the second answer over the context read it from there
    assert final_stats(streamed.content)["target_prefix_hit"]
    assert sse_events(streamed.content)[-1] == "[DONE]"


def test_the_question_is_kept_as_sent(client, model):
    """A question with white space around it (a template's "Answer: ") is read as sent."""
    chat = messages(" Question: how high is the lighthouse?\nAnswer: ")
    alone = naive(client, model, chat)["choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json=body(model, chat, turborag_rapid=True))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == alone


def test_per_request_gamma_and_eta_and_include_usage(client, model):
    chat = messages(QUESTIONS[1])
    alone = naive(client, model, chat)["choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json=body(
        model, chat, turborag_rapid={"gamma": 2, "eta": 0}, stream=True,
        stream_options={"include_usage": True}))
    assert r.status_code == 200, r.text
    events = sse_events(r.content)
    assert text_of(r.content, True) == alone
    finishing, last, done = events[-3:]
    assert finishing["choices"][0]["finish_reason"] == "length" and "usage" not in finishing
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == MAX_TOKENS
    assert last["turborag"]["gamma"] == 2 and last["turborag"]["policy"]["mean_gamma"] <= 2
    assert done == "[DONE]"


def test_turborag_rapid_false_is_an_ordinary_request(client, model):
    r = client.post("/v1/chat/completions", json=body(model, messages(), turborag_rapid=False))
    assert r.status_code == 200 and r.json()["turborag"]["mode"] == "turbo"


def test_rapid_metrics(client, model):
    def figures() -> dict:
        found = {}
        for line in client.get("/metrics").text.splitlines():
            name, _, value = line.partition(" ")
            if name.startswith("turborag_rapid_") and name.endswith("_total"):
                found[name] = float(value)
        return found

    before = figures()
    r = client.post("/v1/chat/completions", json=body(model, messages(QUESTIONS[2]),
                                                      turborag_rapid=True))
    stats = r.json()["turborag"]
    after = figures()
    assert after["turborag_rapid_requests_total"] == before["turborag_rapid_requests_total"] + 1
    assert after["turborag_rapid_drafted_tokens_total"] == \
        before["turborag_rapid_drafted_tokens_total"] + stats["drafted"]
    assert after["turborag_rapid_accepted_tokens_total"] == \
        before["turborag_rapid_accepted_tokens_total"] + stats["accepted"]


def test_a_context_too_long_for_the_target(client, model):
    r = client.post("/v1/chat/completions", json=body(
        model, messages(context=CONTEXT * 6), turborag_rapid=True))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # the turn was given back
    assert client.post("/v1/chat/completions", json=body(
        model, messages(), turborag_rapid=True, max_tokens=2)).status_code == 200


# ---- what RAPID refuses ----------------------------------------------------------------------
@pytest.mark.parametrize("params, param, says", [
    ({"turborag_mode": "naive"}, "turborag_mode", "send one of them"),
    ({"turborag_recovery": "select:0.15"}, "turborag_recovery", "leave it out"),
    ({"turborag_chunks": [DOCS[0]]}, "turborag_chunks", "leave turborag_chunks out"),
    ({"cache_salt": "s1"}, "cache_salt", "not split by cache_salt"),
    ({"turborag_rapid": {"gamma": 0}}, "turborag_rapid", "gamma must be an integer from 1 to 32"),
    ({"turborag_rapid": {"gamma": 33}}, "turborag_rapid", "from 1 to 32, not 33"),
    ({"turborag_rapid": {"eta": -1}}, "turborag_rapid", "eta must be a finite number ≥ 0"),
    ({"turborag_rapid": {"beta": 1}}, "turborag_rapid", "takes gamma and eta, not 'beta'"),
    ({"turborag_rapid": "yes"}, "turborag_rapid", 'true, or an object of per-request overrides'),
])
def test_settings_rapid_cannot_take_are_400s(client, model, params, param, says):
    r = client.post("/v1/chat/completions", json=body(model, messages(),
                                                      **{"turborag_rapid": True, **params}))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


FORM = "an optional system message and one user message whose text is the long context, a " \
       "blank line, then the question"


@pytest.mark.parametrize("chat, says", [
    (messages() + [{"role": "assistant", "content": "41 metres."}], "these are: system, user, "
                                                                     "assistant"),
    ([{"role": "user", "content": "Hi."}] + messages(system=None), "these are: user, user"),
    ([{"role": "system", "content": SYSTEM}], "these are: system"),
    (messages(context=""), "no blank line with text on both sides"),
    ([{"role": "user", "content": f"{DOCS[0]} How high is it?"}], "no blank line"),
    ([{"role": "user", "content": f"{CONTEXT}\n\nHow high is it?\n\n"}], "no blank line"),
    ([{"role": "system", "content": ""}] + messages(system=None), "another prompt"),
])
def test_messages_of_another_form_are_400s_naming_the_form(client, model, chat, says):
    r = client.post("/v1/chat/completions", json=body(model, chat, turborag_rapid=True))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and FORM in error["message"] and says in \
        error["message"], error


def test_text_completions_refuse_rapid_naming_chat_completions(client, model):
    r = client.post("/v1/completions", json={"model": model, "prompt": f"{CONTEXT}\n\nHow high?",
                                             "turborag_rapid": True})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "turborag_rapid" and "/v1/chat/completions" in error["message"]


def test_a_server_without_a_drafter_names_the_flag(engine, model):
    with TestClient(create_app(engine)) as plain:
        r = plain.post("/v1/chat/completions", json=body(model, messages(), turborag_rapid=True))
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "turborag_rapid"
        assert "turborag serve --rapid-drafter MODEL" in r.json()["error"]["message"]
        # and answers everything else as before
        assert plain.post("/v1/chat/completions", json=body(model, messages())).status_code == 200


def test_tenants_get_no_rapid(engine, model, rapid, tmp_path):
    keys = KeyFile(tmp_path / "keys.json", create=True)
    _, key = keys.add("acme")
    with TestClient(create_app(engine, keys=keys)) as tenants:
        r = tenants.post("/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                         json=body(model, messages(), turborag_rapid=True))
        assert r.status_code == 400 and "not served to tenants" in r.json()["error"]["message"]
    with pytest.raises(ValueError, match="not served to tenants"):
        create_app(engine, keys=keys, rapid=rapid)
    with pytest.raises(ValueError, match="not served to tenants"):
        create_app(engine, keys=keys, rapid_drafter="self")
    with pytest.raises(ValueError, match="not both"):
        create_app(engine, rapid=rapid, rapid_drafter="self")


def test_the_drafter_loads_like_the_served_model_onto_its_store(engine, monkeypatch):
    from turborag_integrations.server import rapid as server_rapid

    made = []

    class Loaded:
        def __init__(self, name, *, store, config):
            made.append((name, store, config))

    class Rapid:
        def __init__(self, target, drafter=None):
            self.target, self.drafter = target, drafter
            self.embedder = "loaded"

    monkeypatch.setattr(server_rapid, "TurboRAGEngine", Loaded)
    monkeypatch.setattr(server_rapid, "RapidEngine", Rapid)
    rapid = server_rapid.load_rapid(engine, "drafter-model")
    (name, store, config), = made
    assert (name, store, config.model) == ("drafter-model", engine.store, engine.config.model)
    assert rapid.target is engine and isinstance(rapid.drafter, Loaded)
    assert server_rapid.load_rapid(engine, "self").drafter is None  # RapidEngine(engine)


# ---- concurrency, disconnection, the queue ------------------------------------------------------
@pytest.fixture(scope="module")
def server(engine, rapid):
    app = create_app(engine, rapid=rapid)
    with running(app) as url:
        yield url, app


def post(url: str, payload: dict) -> str:
    r = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    return text_of(r.content, bool(payload.get("stream")))


def test_rapid_and_batched_requests_together_get_their_answers_alone(server, model):
    url, _ = server
    payloads = []
    for i, question in enumerate(QUESTIONS):
        chat = messages(question, context="\n\n".join([DOCS[i], DOCS[(i + 1) % 3]]))
        payloads.append(body(model, chat, turborag_rapid=True, stream=i % 2 == 1,
                             max_tokens=32 + 8 * i))
        payloads.append(body(model, chat, stream=i % 2 == 0, max_tokens=40 + 8 * i))
    alone = [post(url, p) for p in payloads]
    assert len(set(alone[::2])) == len(QUESTIONS)  # different prompts, different answers

    results: list = [None] * len(payloads)
    barrier = threading.Barrier(len(payloads))

    def client(i: int) -> None:
        barrier.wait()
        try:
            results[i] = post(url, payloads[i])
        except BaseException as exc:  # compared below
            results[i] = exc

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert results == alone


LONG = 1200  # tokens: seconds of RAPID rounds (the answers never end early: conftest)
ENDED = re.compile(r"chatcmpl-\w+: (\w+) after (\d+) tokens \(rapid")


def rapid_ends(caplog) -> list:
    """The RAPID answers the server logged as ended: (finish reason, tokens) matches."""
    return [m for rec in caplog.records if rec.name == "turborag.server"
            and (m := ENDED.match(rec.getMessage()))]


def test_a_client_that_leaves_stops_its_rapid_answer(server, model, caplog):
    caplog.set_level(logging.INFO, logger="turborag.server")
    url, _ = server
    sock = post_raw(url, body(model, messages(), turborag_rapid=True, stream=True,
                              max_tokens=LONG))
    first_chunk(sock)  # it is decoding
    sock.close()
    wait_until(lambda: rapid_ends(caplog), "the RAPID answer to end", timeout=30)
    (match,) = rapid_ends(caplog)
    assert match[1] == "cancelled" and int(match[2]) < LONG
    # its turn was given back: the next RAPID answer runs
    assert post(url, body(model, messages(), turborag_rapid=True, max_tokens=4))


def test_a_rapid_request_waits_for_the_turn_within_the_queue(engine, rapid, model, caplog):
    """One RAPID answer runs at a time: the next waits for it, counted among the requests
    waiting for the model (a 429 past max_queue), and one whose client leaves while it waits
    gives up its place and never runs."""
    caplog.set_level(logging.INFO, logger="turborag.server")
    app = create_app(engine, rapid=rapid, max_queue=2)
    held = threading.Event()
    with running(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        health = lambda: http.get("/health").json()  # noqa: E731
        first = post_raw(url, body(model, messages(), turborag_rapid=True, stream=True,
                                   max_tokens=LONG))
        first_chunk(first)
        # hold the model's thread: the first answer's next step waits behind this call
        blocked = app.state.scheduler.call(lambda: held.wait(60))
        statuses = []
        second = threading.Thread(target=lambda: statuses.append(http.post(
            "/v1/chat/completions", json=body(model, messages(), turborag_rapid=True,
                                              max_tokens=4)).status_code))
        second.start()
        wait_until(lambda: health()["queue_depth"] == 1, "the second RAPID request to wait")
        third = post_raw(url, body(model, messages(QUESTIONS[1]), turborag_rapid=True))
        wait_until(lambda: health()["queue_depth"] == 2, "the third RAPID request to wait")
        refused = http.post("/v1/chat/completions", json=body(model, messages(),
                                                              turborag_rapid=True))
        assert refused.status_code == 429
        third.close()
        wait_until(lambda: health()["queue_depth"] == 1, "the third to give up its place")
        first.close()
        held.set()
        blocked.result(60)
        second.join(120)
        assert statuses == [200]  # it got the turn once the first let it go
        assert health()["queue_depth"] == 0
    # the first was cut short, the second ran, the third never did
    assert [m[1] for m in rapid_ends(caplog)] == ["cancelled", "length"]


# ---- stock OpenAI clients, over a real socket -------------------------------------------------
def test_the_openai_sdk_asks_for_rapid_with_extra_body(server, model):
    openai = pytest.importorskip("openai")
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chat = messages(QUESTIONS[2])
    alone = post(url, body(model, chat, turborag_mode="naive"))
    completion = client.chat.completions.create(
        model=model, messages=chat, temperature=0, max_tokens=MAX_TOKENS,
        extra_body={"turborag_rapid": True})
    assert completion.choices[0].message.content == alone
    stats = completion.model_extra["turborag"]
    assert stats["mode"] == "rapid" and stats["drafted"] > 0
    assert completion.usage.completion_tokens == MAX_TOKENS

    chunks = list(client.chat.completions.create(
        model=model, messages=chat, temperature=0, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"turborag_rapid": {"gamma": 3}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == alone
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].model_extra["turborag"]["gamma"] == 3

    with pytest.raises(openai.BadRequestError, match="not split by cache_salt"):
        client.chat.completions.create(model=model, messages=chat,
                                       extra_body={"turborag_rapid": True, "cache_salt": "s"})


def rapid_answers(url: str) -> float:
    """RAPID answers the server has counted."""
    metrics = httpx.get(f"{url}/metrics").text
    (line,) = [x for x in metrics.splitlines() if x.startswith("turborag_rapid_requests_total ")]
    return float(line.split()[1])


def test_llama_index_openai_like_with_additional_kwargs(server, model):
    """docs/rapid.md's LlamaIndex client, as written there."""
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.llms.openai_like import OpenAILike

    url, _ = server
    chat = messages(system=None)
    alone = post(url, body(model, chat, turborag_mode="naive"))
    llm = OpenAILike(model=model, api_base=f"{url}/v1", api_key="unused", is_chat_model=True,
                     temperature=0, max_tokens=MAX_TOKENS,
                     additional_kwargs={"extra_body": {"turborag_rapid": True}})
    before = rapid_answers(url)
    assert llm.complete(chat[0]["content"]).text == alone
    assert "".join(r.delta for r in llm.stream_complete(chat[0]["content"])) == alone
    assert rapid_answers(url) == before + 2


def test_langchain_chat_openai_with_extra_body(server, model):
    """docs/rapid.md's LangChain client, as written there."""
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    url, _ = server
    chat = messages(QUESTIONS[1])
    alone = post(url, body(model, chat, turborag_mode="naive"))
    llm = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused", temperature=0,
                     max_tokens=MAX_TOKENS, extra_body={"turborag_rapid": True})
    pairs = [(m["role"], m["content"]) for m in chat]
    before = rapid_answers(url)
    assert llm.invoke(pairs).content == alone
    assert "".join(c.content for c in llm.stream(pairs)) == alone
    assert rapid_answers(url) == before + 2
