"""LangChain's standard conformance suites, run against a tiny random-weight model.

A random model cannot follow instructions, call tools or read images; the suites' capability
flags say so and LangChain skips those tests with its own reason. Everything else (invoke,
stream, async, batch, stop, usage metadata, callbacks, standard params) runs for real.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests, VectorStoreIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from turborag_integrations.langchain import ChunkRegistry, KVCachingVectorStore, TurboRAGChatModel

from .conftest import cached_tiny_engine


class _Config:
    @property
    def chat_model_class(self) -> type[TurboRAGChatModel]:
        return TurboRAGChatModel

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"engine": cached_tiny_engine(0), "registry": ChunkRegistry()}

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine, one model: a per-call model is refused

    @property
    def supported_usage_metadata_details(self):
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False):
        """A prompt with a cached document: usage reports the reused tokens as cache reads."""
        engine = cached_tiny_engine(0)
        doc = "Velmora is a harbor town that trades salt fish, amber and rope."
        engine.encode_chunks([doc])
        model = TurboRAGChatModel(engine=engine, max_tokens=4, chunks=[doc])
        prompt = f"Context:\n{doc}\n\nWhat does Velmora trade?"
        if not stream:
            return model.invoke(prompt)
        full = None
        for chunk in model.stream(prompt):
            full = chunk if full is None else full + chunk
        return full


class TestTurboRAGChatModelUnit(_Config, ChatModelUnitTests):
    pass


class TestTurboRAGChatModelIntegration(_Config, ChatModelIntegrationTests):
    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        return {"max_tokens": 8}  # random weights: a few tokens show everything, fast


class TestKVCachingVectorStore(VectorStoreIntegrationTests):
    @pytest.fixture
    def vectorstore(self, tmp_path) -> KVCachingVectorStore:
        """An empty wrapper over embedded Chroma in tmp_path, blobs in its own KV store."""
        from turborag_integrations.core.engine import TurboRAGEngine

        engine = TurboRAGEngine(cached_tiny_engine(0).loaded, store=str(tmp_path / "kv"),
                                progress=False)
        store = KVCachingVectorStore(engine=engine, embedding=self.get_embeddings(),
                                     persist_directory=str(tmp_path / "chroma"),
                                     registry=ChunkRegistry())
        yield store
        # Every document the suite left behind still has its blob; deleting them must empty
        # the KV store, or blobs would leak.
        remaining = store.vectorstore.get()["ids"]
        store.delete(remaining)
        assert not list(engine.store.disk.keys())
