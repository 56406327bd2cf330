"""`turborag serve`: its options reach the server, which loads the engine and runs uvicorn."""

import uvicorn
from fastapi import FastAPI
from typer.testing import CliRunner

from turborag_integrations.cli import app as cli
from turborag_integrations.server import app as server_app


def test_serve_defaults_to_the_bundled_model_default_store_and_loopback(monkeypatch):
    calls = []
    monkeypatch.setattr(server_app, "serve", lambda **kwargs: calls.append(kwargs))
    result = CliRunner().invoke(cli, ["serve"])
    assert result.exit_code == 0, result.output
    assert calls == [{"model": None, "store": None, "host": "127.0.0.1", "port": 8000,
                      "adapter": "default"}]
    CliRunner().invoke(cli, ["serve", "--model", "m", "--store", "kv", "--port", "9000"])
    assert calls[1]["model"] == "m" and str(calls[1]["store"]) == "kv" and calls[1]["port"] == 9000


def test_serve_warms_the_engine_up_and_runs_the_app(monkeypatch, engine):
    made, ran = [], []

    class Engine:
        def __init__(self, model, *, store, adapter):
            made.append((model, store, adapter))

        def __enter__(self):
            return engine

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(server_app, "TurboRAGEngine", Engine)
    monkeypatch.setattr(engine, "warmup", lambda: ran.append("warmup"))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: ran.append((app, kwargs)))
    server_app.serve(model="m", store="kv", port=9000)
    assert made == [("m", "kv", "default")]
    assert ran[0] == "warmup" and isinstance(ran[1][0], FastAPI)
    assert ran[1][1]["host"] == "127.0.0.1" and ran[1][1]["port"] == 9000
