"""End to end with the bundled SmolLM2: ingest, retrieve, answer through the stock engine."""

from __future__ import annotations

import pytest

from turborag_integrations.llama_index import KVCachingVectorStore, TurboRAGLLM

from .conftest import build_index
from .test_query_engines import QUESTION, chunk_tokens


@pytest.mark.real_model
def test_smollm2_query_engine_reuses_chunks(smollm2, embed_model, tmp_path):
    from turborag_integrations.core.engine import TurboRAGEngine

    engine = TurboRAGEngine(smollm2, store=tmp_path / "kv", progress=False)
    index = build_index(KVCachingVectorStore(engine, path=tmp_path / "chroma"), embed_model)
    llm = TurboRAGLLM(engine, max_new_tokens=4)
    qe = index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()],
                               similarity_top_k=2)
    response = qe.query(QUESTION)
    assert str(response).strip()
    stats = llm.last_stats
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0
    assert stats["reused_tokens"] >= chunk_tokens(engine, response.source_nodes)
    assert "lighthouse" in response.source_nodes[0].node.get_content()
