"""End to end on the real bundled SmolLM2-135M: Chroma + MiniLM retrieval, LCEL chain, reuse."""

from __future__ import annotations

import pytest
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from turborag_integrations.core.retrieval.chunking import split_text
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.langchain import ChunkRegistry, KVCachingVectorStore, TurboRAGChatModel

from .helpers import PROMPT, SAMPLE_DOCS, format_docs

pytestmark = pytest.mark.real_model


def test_lcel_rag_chain_on_smollm2(smollm2, minilm, tmp_path):
    engine = TurboRAGEngine(smollm2, store=str(tmp_path / "kv"), progress=False)
    registry = ChunkRegistry()
    store = KVCachingVectorStore(engine=engine, embedding=minilm, registry=registry,
                                 persist_directory=str(tmp_path / "chroma"))
    text = (SAMPLE_DOCS / "harbor_town_of_velmora.md").read_text()
    store.add_texts(split_text(text, engine.tokenizer, 128))

    llm = TurboRAGChatModel(engine=engine, registry=registry, max_tokens=12)
    retriever = store.as_retriever(search_kwargs={"k": 3})
    context = {"context": retriever | RunnableLambda(format_docs),
               "question": RunnablePassthrough()}
    question = "How high is the Tall Widow lighthouse?"

    chunks = list((context | PROMPT | llm).stream(question))
    answer = "".join(c.content for c in chunks)
    stats = chunks[-1].response_metadata["turborag"]
    assert stats["cache_hits"] == 3 and stats["cache_misses"] == 0
    assert stats["reused_tokens"] > stats["prefilled_tokens"]
    assert "38" in answer

    naive = (context | PROMPT | llm.bind(mode="naive")).invoke(question)
    assert naive.response_metadata["turborag"]["reused_tokens"] == 0
    assert "38" in naive.content
