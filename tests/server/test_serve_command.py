"""`turborag serve`: its options reach the server, which loads the engine on a thread of its own,
warms it up on the batch scheduler's thread, and runs uvicorn."""

import json
import threading

import pytest

import torch
import uvicorn
from fastapi import FastAPI
from typer.testing import CliRunner

from turborag_integrations.cli import app as cli
from turborag_integrations.core.config import EngineConfig, QueryConfig
from turborag_integrations.core.prefill.context import DEFAULT_CONTEXT_TOKENS
from turborag_integrations.core.prefill.recovery import parse_recovery
from turborag_integrations.core.settings import DEFAULT_RECOVERY
from turborag_integrations.server import app as server_app
from turborag_integrations.server.config import ServerConfig

DEFAULTS = {"model": None, "kv_store": None, "host": "127.0.0.1", "port": 8000,
            "encoder": "default", "mode": "turbo",
            "recovery": str(parse_recovery(DEFAULT_RECOVERY)), "max_batch": 8, "max_queue": 64,
            "max_body_bytes": 8 * 2**20, "api_key": None, "keys": None, "threads": None,
            "question_last": False, "context_tokens": DEFAULT_CONTEXT_TOKENS, "prompts": [],
            "device": "cpu", "dtype": "float32", "admit_after": None, "rapid_drafter": None}


def flat(model, *, store, config, server, prompts, host, port, threads) -> dict:
    """What `serve` was given, by the CLI's option names: the engine's and the server's
    configurations read back field by field."""
    return {"model": model, "kv_store": store, "host": host, "port": port, "threads": threads,
            "prompts": prompts, "encoder": config.encoding.encoder,
            "recovery": str(config.query.recovery), "question_last": config.query.question_last,
            "context_tokens": config.encoding.context_tokens, "device": config.model.device,
            "admit_after": config.admission.admit_after,
            "dtype": config.model.dtype, "mode": server.mode, "max_batch": server.max_batch,
            "max_queue": server.max_queue, "max_body_bytes": server.max_body_bytes,
            "api_key": server.api_key, "keys": server.keys, "rapid_drafter": server.rapid_drafter}


def test_serve_options_reach_the_server(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(server_app, "serve", lambda *args, **kwargs: calls.append(
        flat(*args, **kwargs)))
    monkeypatch.delenv("TURBORAG_API_KEY", raising=False)
    runner = CliRunner()
    result = runner.invoke(cli, ["serve"])
    assert result.exit_code == 0, result.output
    assert calls == [DEFAULTS]
    result = runner.invoke(cli, ["serve", "--model", "m", "--kv-store", "kv", "--port", "9000",
                                 "--mode", "naive", "--max-batch", "4", "--max-queue", "10",
                                 "--max-body-bytes", "1MiB", "--api-key", "k1", "--threads", "1",
                                 "--question-last", "--context-tokens", "256",
                                 "--admit-after", "2", "--rapid-drafter", "self"])
    assert result.exit_code == 0, result.output
    assert {**calls[1], "kv_store": str(calls[1]["kv_store"])} == {
        **DEFAULTS, "model": "m", "kv_store": "kv", "port": 9000, "mode": "naive", "max_batch": 4,
        "max_queue": 10, "max_body_bytes": 2**20, "api_key": "k1", "threads": 1,
        "question_last": True, "context_tokens": 256, "admit_after": 2, "rapid_drafter": "self"}
    chat = tmp_path / "rag.json"
    messages = [{"role": "system", "content": "Answer from the context."},
                {"role": "user", "content": "Context:\n{context}\n\nQuestion: {question}"}]
    chat.write_text(json.dumps(messages))
    (tmp_path / "rag.txt").write_text("Read:\n{context}\nQ: {question}\nA:")
    result = runner.invoke(cli, ["serve", "--prompt", str(chat), "--prompt",
                                 str(tmp_path / "rag.txt")])
    assert result.exit_code == 0, result.output
    assert calls[-1]["prompts"] == [messages, "Read:\n{context}\nQ: {question}\nA:"]
    result = runner.invoke(cli, ["serve"], env={"TURBORAG_API_KEY": "k2"})
    assert result.exit_code == 0 and calls[-1]["api_key"] == "k2"


def test_serve_refuses_bad_options(monkeypatch, tmp_path):
    monkeypatch.setattr(server_app, "serve", lambda *args, **kwargs: pytest.fail("served"))
    no_context = tmp_path / "p.txt"
    no_context.write_text("Question: {question}\nAnswer:")
    not_chat = tmp_path / "p.json"
    not_chat.write_text(json.dumps({"role": "user", "content": "{context}"}))
    runner = CliRunner()
    for args, says in ((["--mode", "fast"], "--mode: mode must be one of ('turbo', 'naive')"),
                       (["--max-body-bytes", "lots"], "--max-body-bytes: not a size"),
                       (["--max-body-bytes", "0"], "at least 1 byte"),
                       (["--api-key", ""], "--api-key is empty"),
                       (["--api-key", "k", "--keys", "keys.json"], "not both"),
                       (["--recovery", "select:2"], "--recovery: bad recovery 'select:2'"),
                       (["--device", "cuda:7"], "--device: device 'cuda:7' is not available"),
                       (["--device", "gpu"], "--device: unknown device 'gpu'"),
                       (["--dtype", "half"], "--dtype: unknown dtype 'half'"),
                       (["--recovery", "fancy:3"], "--recovery: unknown recovery 'fancy:3'"),
                       (["--admit-after", "0"], "admit_after must be an integer ≥ 1"),
                       (["--rapid-drafter", " "], "the RAPID drafter is empty"),
                       (["--rapid-drafter", "self", "--keys", "keys.json"],
                        "--rapid-drafter cannot serve --keys")):
        result = runner.invoke(cli, ["serve", *args])
        assert result.exit_code == 2 and says in result.output, (args, result.output)
    for args, says in ((["--prompt", "missing.txt"], "cannot read the prompt template"),
                       (["--prompt", str(no_context)], "has no {context}"),
                       (["--prompt", str(not_chat)], "a list of chat messages")):
        result = runner.invoke(cli, ["serve", *args])
        assert result.exit_code == 2 and says in result.output, (args, result.output)
    for args in (["--max-batch", "0"], ["--max-queue", "0"], ["--threads", "0"]):
        assert runner.invoke(cli, ["serve", *args]).exit_code == 2


def test_serve_loads_on_a_thread_that_ends_and_warms_up_on_the_schedulers(monkeypatch, engine):
    made, ran = [], []

    def load(model, *, store, config):
        made.append((model, store, config, threading.current_thread()))
        return engine

    monkeypatch.setattr(server_app, "TurboRAGEngine", load)
    monkeypatch.setattr(engine, "close", lambda: ran.append("close"))  # the fixture's engine
    monkeypatch.setattr(engine, "warmup", lambda: ran.append(
        (threading.current_thread().name, torch.get_num_threads())))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.append((app, kwargs)))
    before = torch.get_num_threads()
    try:
        server_app.serve("m", store="kv",
                         config=EngineConfig(query=QueryConfig(question_last=True)),
                         server=ServerConfig(max_batch=3, api_key="k"), port=9000, threads=1,
                         prompts=["Read:\n{context}\nQ: {question}\nA:"])
    finally:
        torch.set_num_threads(before)
    (model, store, config, loader), = made
    # chunks encoded with the shipped encoder, the default recovery
    assert (model, store, config.encoding.encoder, str(config.query.recovery),
            config.query.question_last) == (
        "m", "kv", "default", str(parse_recovery(DEFAULT_RECOVERY)), True)
    assert loader is not threading.current_thread() and not loader.is_alive()
    # warmed up on the scheduler's thread, which runs torch with the threads asked for
    assert ran[0] == ("turborag-batch", 1)
    app, kwargs = ran[1]
    assert isinstance(app, FastAPI) and app.state.scheduler.max_batch == 3
    assert kwargs["host"] == "127.0.0.1" and kwargs["port"] == 9000
    assert ran[2] == "close"
    assert engine.library.prompt_heads == [tuple(engine.tokenizer("Read:\n", add_special_tokens=False)
                                         ["input_ids"])]  # the template's head, before serving
    app.state.scheduler.close()  # uvicorn did not run the app's shutdown


def rapid_refusal(monkeypatch, model_dir, tmp_path, drafter: str):
    """`turborag serve --rapid-drafter DRAFTER` over the tiny model; serving must not start."""
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: pytest.fail("served"))
    return CliRunner().invoke(cli, ["serve", "--model", model_dir, "--kv-store",
                                    str(tmp_path / "kv"), "--rapid-drafter", drafter])


def test_a_drafter_that_does_not_load_fails_before_serving(monkeypatch, model_dir, tmp_path):
    missing = str(tmp_path / "no-such-model")
    result = rapid_refusal(monkeypatch, model_dir, tmp_path, missing)
    assert result.exit_code == 2, result.output
    assert f"the RAPID drafter {missing!r} did not load: could not load model" in result.output


def test_a_drafter_of_another_vocabulary_fails_before_serving(monkeypatch, model_dir, tmp_path):
    from tests.conftest import tiny_model

    other = tiny_model("llama", merges=(("Ġ", "t"),))  # one token more: another vocabulary
    other.model.save_pretrained(tmp_path / "other")
    other.tokenizer.save_pretrained(tmp_path / "other")
    result = rapid_refusal(monkeypatch, model_dir, tmp_path, str(tmp_path / "other"))
    assert result.exit_code == 2, result.output
    assert "RAPID needs one vocabulary" in result.output


def test_serve_loads_and_warms_up_a_rapid_drafter(monkeypatch, model_dir, tmp_path):
    ran = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.append(app))
    result = CliRunner().invoke(cli, ["serve", "--model", model_dir, "--kv-store",
                                      str(tmp_path / "kv"), "--rapid-drafter", model_dir])
    assert result.exit_code == 0, result.output
    (app,) = ran
    rapid = app.state.rapid
    assert rapid.drafter is not rapid.target and rapid.drafter.store is rapid.target.store
    assert rapid.drafter.config.model == rapid.target.config.model
    app.state.scheduler.close()  # uvicorn did not run the app's shutdown
