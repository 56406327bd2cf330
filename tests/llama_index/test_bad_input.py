"""What goes wrong in real deployments still gives an answer, and the stats say why; a store
built for another model is refused, naming both."""

from __future__ import annotations

import logging

import pytest
from llama_index.core.chat_engine import SimpleChatEngine
from llama_index.core.postprocessor import SimilarityPostprocessor
from llama_index.vector_stores.chroma import ChromaVectorStore

from tests.conftest import tiny_model
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.errors import FingerprintMismatch
from turborag_integrations.llama_index import KV_KEY_METADATA, KVCachePostprocessor, TurboRAGLLM

from .conftest import build_index
from .test_query_engines import QUESTION


def test_text_changed_after_ingestion_is_prefilled_not_served_stale(index, kv_store, engine,
                                                                    caplog):
    node = next(n for n in kv_store.get_nodes() if n.ref_doc_id == "lighthouse")
    stale_key = node.metadata[KV_KEY_METADATA]
    # someone edits the text in the database, behind the wrapper's back
    collection = kv_store.client
    vector = collection.get(ids=[node.node_id], include=["embeddings"])["embeddings"][0]
    collection.update(ids=[node.node_id], embeddings=[vector],
                      documents=["The Tall Widow lighthouse is 44 metres high since 1990."])
    llm = TurboRAGLLM(engine, max_new_tokens=6)
    strict = KVCachePostprocessor(engine, encode_missing=False)
    qe = index.as_query_engine(llm=llm, node_postprocessors=[strict], similarity_top_k=1)
    with caplog.at_level(logging.WARNING):
        response = qe.query(QUESTION)
    assert "44 metres" in response.source_nodes[0].node.get_content()
    assert str(response)
    stats = llm.last_stats
    assert stats["cache_hits"] == 0 and stats["cache_misses"] == 1
    assert "stale" in caplog.text
    assert engine.store.contains(stale_key)  # still there for the old text, never used here
    # the default postprocessor encodes the new text once; from then on it is reused
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine)],
                               similarity_top_k=1)
    qe.query(QUESTION)
    assert llm.last_stats["cache_hits"] == 1 and llm.last_stats["cache_misses"] == 0


def test_plain_vector_store_without_the_wrapper_still_answers(engine, embed_model, tmp_path):
    import chromadb

    client = chromadb.PersistentClient(path=str(tmp_path / "plain"))
    plain = ChromaVectorStore(chroma_collection=client.get_or_create_collection("plain"))
    index = build_index(plain, embed_model)
    llm = TurboRAGLLM(engine, max_new_tokens=6)
    qe = index.as_query_engine(
        llm=llm, similarity_top_k=2,
        node_postprocessors=[KVCachePostprocessor(engine, encode_missing=False)])
    assert str(qe.query(QUESTION))
    stats = llm.last_stats
    assert stats["cache_misses"] == 2 and stats["cache_hits"] == 0
    naive = llm.baseline()
    qe_naive = index.as_query_engine(llm=naive, similarity_top_k=2)
    qe_naive.query(QUESTION)
    # nothing of the chunks was reused: only the template head before them can be
    assert stats["prefilled_tokens"] > 0
    assert stats["prompt_tokens"] == naive.last_stats["prompt_tokens"]
    # with the default postprocessor, nodes from before the wrapper get their blobs at query time
    qe = index.as_query_engine(llm=llm, similarity_top_k=2,
                               node_postprocessors=[llm.postprocessor()])
    qe.query(QUESTION)
    assert llm.last_stats["cache_hits"] == 2


def test_empty_retrieval(index, engine):
    llm = TurboRAGLLM(engine, max_new_tokens=6)
    cutoff = SimilarityPostprocessor(similarity_cutoff=1.01)  # nothing passes
    qe = index.as_query_engine(llm=llm, similarity_top_k=2,
                               node_postprocessors=[cutoff, llm.postprocessor()])
    response = qe.query(QUESTION)
    # LlamaIndex's synthesizers do not call the LLM without context; nothing breaks on our side
    assert str(response) == "Empty Response" and not response.source_nodes
    assert llm.last_result is None
    # without retrieval the LLM answers from the question alone, with nothing to look up even
    # though earlier queries registered chunks
    index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()]).query(QUESTION)
    assert len(llm.registry) > 0
    reply = SimpleChatEngine.from_defaults(llm=llm).chat(QUESTION)
    assert reply.response
    assert llm.last_stats["cache_hits"] == 0 and llm.last_stats["cache_misses"] == 0
    assert llm.last_stats["new_tokens"] > 0


def test_chunks_registered_for_another_model_are_refused(index, kv_store, engine, tmp_path):
    """An LLM on another model, handed the registry the store filled (texts ingested for the
    store's model), says so instead of silently prefilling them."""
    other = TurboRAGEngine(tiny_model("llama", seed=1), store=tmp_path / "kv2", progress=False)
    assert other.fingerprint.id != engine.fingerprint.id
    llm = TurboRAGLLM(other, registry=kv_store.registry, max_new_tokens=2)
    qe = index.as_query_engine(llm=llm, similarity_top_k=1)
    with pytest.raises(FingerprintMismatch) as err:
        qe.query(QUESTION)
    assert engine.fingerprint.id in str(err.value) and other.fingerprint.id in str(err.value)
    # Opting out of the check: the chunk is simply prefilled.
    unchecked = TurboRAGLLM(other, registry=kv_store.registry, max_new_tokens=2,
                            check_fingerprint=False)
    index.as_query_engine(llm=unchecked, similarity_top_k=1).query(QUESTION)
    assert unchecked.last_stats["cache_hits"] == 0 and unchecked.last_stats["cache_misses"] == 1
    # A postprocessor on the other engine makes the chunk's blob for its model: then it is used.
    qe = index.as_query_engine(llm=llm, similarity_top_k=1,
                               node_postprocessors=[llm.postprocessor()])
    qe.query(QUESTION)
    assert llm.last_stats["cache_hits"] == 1
