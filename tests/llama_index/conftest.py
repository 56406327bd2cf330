"""Fixtures for the LlamaIndex adapters: real llama-index-core, embedded Chroma, real MiniLM."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_model

DOCS = {
    "lighthouse": "The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora. "
                  "It was first lit in 1871 and its lamp burns whale oil no longer.",
    "ferry": "The Velmora ferry stops running every January, when the harbour freezes over "
             "and the fishermen pull their boats onto the ice.",
    "kiln": "The Orbital Kiln Company fires ceramic tiles for satellites in a vacuum furnace "
            "heated to 1600 degrees by mirrored sunlight.",
}


@pytest.fixture(scope="session")
def embed_model():
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from turborag_integrations.core.retrieval.embedding import default_embedding_path

    return HuggingFaceEmbedding(model_name=default_embedding_path())


def make_engine(folder):
    from turborag_integrations.core.engine import TurboRAGEngine

    return TurboRAGEngine(tiny_model("llama"), store=folder / "kv", progress=False)


@pytest.fixture
def engine(tmp_path):
    return make_engine(tmp_path)


def documents():
    from llama_index.core import Document

    return [Document(text=text, id_=name, metadata={"source": f"{name}.md"})
            for name, text in DOCS.items()]


def build_index(vector_store, embed_model, docs=None):
    from llama_index.core import StorageContext, VectorStoreIndex

    return VectorStoreIndex.from_documents(
        docs if docs is not None else documents(), embed_model=embed_model,
        storage_context=StorageContext.from_defaults(vector_store=vector_store))


@pytest.fixture
def kv_store(engine, tmp_path):
    from turborag_integrations.llama_index import KVCachingVectorStore

    return KVCachingVectorStore(engine, path=tmp_path / "chroma")


@pytest.fixture
def index(kv_store, embed_model):
    return build_index(kv_store, embed_model)


@pytest.fixture
def llm_events():
    """Every turborag stats payload that reaches LlamaIndex's instrumentation, in order."""
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler

    seen: list[dict] = []

    class Collect(BaseEventHandler):
        def handle(self, event, **kwargs):
            response = getattr(event, "response", None)
            extra = getattr(response, "additional_kwargs", None) or {}
            if type(event).__name__.endswith("EndEvent") and "turborag" in extra:
                seen.append(extra["turborag"])

    handler = Collect()
    root = get_dispatcher()
    root.add_event_handler(handler)
    yield seen
    root.event_handlers.remove(handler)
