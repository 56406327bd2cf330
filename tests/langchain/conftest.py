"""Fixtures for the LangChain adapters: a tiny random model behind a real engine and KV store,
embedded Chroma under tmp_path, and the real MiniLM embeddings."""

from __future__ import annotations

import atexit
import inspect
import shutil
import tempfile
from functools import lru_cache

import pytest

from tests.conftest import tiny_model
from turborag_integrations.core.engine import TurboRAGEngine


@lru_cache(maxsize=None)
def cached_tiny_engine(seed: int = 0) -> TurboRAGEngine:
    """One tiny engine per seed for the whole run (the standard suites build a model per test
    from constant parameters, so it cannot come from a fixture)."""
    root = tempfile.mkdtemp(prefix="turborag-lc-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return TurboRAGEngine(tiny_model("llama", seed=seed), store=f"{root}/kv", progress=False)


@pytest.fixture
def engine(tmp_path) -> TurboRAGEngine:
    """A tiny engine with its own, empty KV store."""
    base = cached_tiny_engine(0)
    return TurboRAGEngine(base.loaded, store=str(tmp_path / "kv"), progress=False)


@pytest.fixture(scope="session")
def minilm():
    from turborag_integrations.langchain import SentenceTransformerEmbeddings

    return SentenceTransformerEmbeddings()


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """LangChain's standard suites expect pytest-asyncio in auto mode; this repo runs it in
    strict mode, so mark their async tests (and only those) as asyncio tests here."""
    if inspect.iscoroutinefunction(obj) and name.startswith("test"):
        if not any(m.name == "asyncio" for m in getattr(obj, "pytestmark", [])):
            pytest.mark.asyncio(obj)
    return None
