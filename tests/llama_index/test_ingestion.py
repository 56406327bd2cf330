"""KVCachingVectorStore: blobs at ingestion, hidden metadata, deletion, IngestionPipeline."""

from __future__ import annotations

import asyncio

import torch
from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode, NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.storage.docstore import SimpleDocumentStore

from turborag_integrations.core.prefill.context import text_before
from turborag_integrations.llama_index import (KV_KEY_METADATA, ChunkRegistry, TurboRAGLLM,
                                               KVCachingVectorStore, llm_text)

from .conftest import DOCS, build_index, documents


def test_add_stores_the_blob_of_the_text_the_llm_sees(index, kv_store, engine):
    nodes = kv_store.get_nodes()
    assert len(nodes) == len(DOCS)
    for node in nodes:
        key = node.metadata[KV_KEY_METADATA]
        assert KV_KEY_METADATA in node.excluded_llm_metadata_keys
        assert KV_KEY_METADATA in node.excluded_embed_metadata_keys
        text = llm_text(node)
        assert KV_KEY_METADATA not in text and text.startswith("source: ")
        assert KV_KEY_METADATA not in node.get_content(metadata_mode=MetadataMode.EMBED)
        assert engine.library.chunk_key(text) == key and engine.store.contains(key)
        assert engine.store.get(key, engine.fingerprint) is not None


def test_delete_removes_the_documents_blobs(index, kv_store, engine, embed_model):
    keys = {n.ref_doc_id: n.metadata[KV_KEY_METADATA] for n in kv_store.get_nodes()}
    index.delete_ref_doc("ferry")
    assert not engine.store.contains(keys["ferry"])
    assert engine.store.contains(keys["kiln"])
    assert {n.ref_doc_id for n in kv_store.get_nodes()} == {"lighthouse", "kiln"}


def test_a_blob_shared_by_two_documents_outlives_one_of_them(engine, tmp_path, embed_model):
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma")
    twins = [Document(text="Same words in two files.", id_=name) for name in ("a", "b")]
    VectorStoreIndex.from_documents(twins, embed_model=embed_model,
                                    storage_context=_context(store))
    (key,) = {n.metadata[KV_KEY_METADATA] for n in store.get_nodes()}
    store.delete("a")
    assert engine.store.contains(key)
    store.delete("b")
    assert not engine.store.contains(key)


def test_ingestion_pipeline_upserts_replace_stale_blobs(engine, tmp_path, embed_model):
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma")
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=64, chunk_overlap=8), embed_model],
                                 vector_store=store, docstore=SimpleDocumentStore())
    pipeline.run(documents=[Document(text="First version of the notes.", id_="notes")])
    (old,) = [n.metadata[KV_KEY_METADATA] for n in store.get_nodes()]
    pipeline.run(documents=[Document(text="Second version of the notes.", id_="notes")])
    (new,) = [n.metadata[KV_KEY_METADATA] for n in store.get_nodes()]
    assert old != new and engine.store.contains(new) and not engine.store.contains(old)
    index = VectorStoreIndex.from_vector_store(store, embed_model=embed_model)
    hit = index.as_retriever(similarity_top_k=1).retrieve("notes")[0]
    assert hit.node.metadata[KV_KEY_METADATA] == new


def test_progress_bar_and_async_add(engine, tmp_path, capsys):
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma", show_progress=True)
    nodes = [TextNode(text=f"Note number {i}.", embedding=[float(i), 1.0, 0.0]) for i in range(3)]
    nodes.append(TextNode(text="   ", embedding=[0.0, 0.0, 1.0]))  # no text: no blob, no error
    asyncio.run(store.async_add(nodes))
    assert "encoding chunk KV" in capsys.readouterr().err
    assert [KV_KEY_METADATA in n.metadata for n in nodes] == [True, True, True, False]
    assert len(store.get_nodes()) == 4


def test_registry_is_bounded_and_matches_verbatim():
    registry = ChunkRegistry(capacity=2, min_chars=1)
    registry.add(["alpha beta", "gamma", "delta"])
    assert "alpha beta" not in registry and len(registry) == 2
    assert registry.found_in("x gamma y delt") == ["gamma"]
    # By default a text too short to be worth a blob is not registered.
    default = ChunkRegistry()
    default.add(["gamma", "a chunk long enough to be worth a blob"])
    assert default.found_in("gamma: a chunk long enough to be worth a blob") == [
        "a chunk long enough to be worth a blob"]


def test_adapters_on_one_engine_share_its_registry(engine, kv_store):
    from turborag_integrations.llama_index import KVCachePostprocessor, TurboRAGLLM

    shared = ChunkRegistry.for_engine(engine)
    llm = TurboRAGLLM(engine)
    assert kv_store.registry is shared and llm.registry is shared
    assert KVCachePostprocessor(engine).registry is shared
    own = ChunkRegistry()
    assert KVCachePostprocessor(TurboRAGLLM(engine, registry=own)).registry is own


def _context(store):
    from llama_index.core import StorageContext

    return StorageContext.from_defaults(vector_store=store)


def test_tenants_on_one_engine_keep_their_documents_and_blobs_apart(engine, tmp_path,
                                                                    embed_model):
    """Two tenants (namespaces) share one engine and Chroma folder: each retrieves only its own
    documents, and a prompt with the other's exact texts reuses nothing."""
    from turborag_integrations.llama_index import TurboRAGLLM

    stores = {t: KVCachingVectorStore(engine, path=tmp_path / "chroma", namespace=t)
              for t in ("acme", "globex")}
    docs = documents()
    build_index(stores["acme"], embed_model, docs[:2])
    index_b = build_index(stores["globex"], embed_model, docs[2:])
    assert {n.ref_doc_id for n in stores["acme"].get_nodes()} == {"lighthouse", "ferry"}
    assert {n.ref_doc_id for n in stores["globex"].get_nodes()} == {"kiln"}
    llm_a, llm_b = TurboRAGLLM(engine, namespace="acme"), TurboRAGLLM(engine, namespace="globex")
    texts = [llm_text(n) for n in stores["acme"].get_nodes()]
    prompt = "Context:\n" + "\n\n".join(texts) + "\nQuestion: how high?"
    llm_a.complete(prompt, max_tokens=2)
    assert llm_a.last_stats["cache_hits"] == 2
    llm_b.complete(prompt, max_tokens=2)
    assert llm_b.last_stats["reused_tokens"] == 0
    retrieved = index_b.as_retriever(similarity_top_k=3).retrieve("How high is the lighthouse?")
    assert {n.node.ref_doc_id for n in retrieved} == {"kiln"}
    assert engine.store.keys() == []  # nothing in the default namespace


def context_blob(engine, text: str, before: str | None):
    """The blob `text` gets when encoded after `before` (None: alone)."""
    enc = engine.library.encoder
    ids = enc.tokenize(text)
    return enc.encode_ids([ids], contexts=[enc.context_ids(before, len(ids))])[0]


def test_nodes_are_encoded_after_their_previous_node(tmp_path, embed_model):
    """With `context_tokens`, a split document's node is encoded after the nodes before it
    (along PREVIOUS relationships), from the same batch or, for a later insert, from the
    store."""
    from turborag_integrations.core.engine import TurboRAGEngine
    from tests.conftest import tiny_model

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", context_tokens=24,
                            progress=False)
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma")
    text = " ".join(f"Sentence number {i} says the harbour froze in year {1900 + i}."
                    for i in range(12))
    index = VectorStoreIndex.from_documents(
        [Document(text=text, id_="doc")], embed_model=embed_model,
        storage_context=StorageContext.from_defaults(vector_store=store),
        transformations=[SentenceSplitter(chunk_size=48, chunk_overlap=0)])
    nodes = {n.node_id: n for n in store.get_nodes()}
    assert len(nodes) > 2

    def chain(node):  # the texts of the nodes before `node`, nearest first
        while node.prev_node is not None:
            node = nodes[node.prev_node.node_id]
            yield node.get_content()

    firsts = 0
    for node in nodes.values():
        before = text_before(chain(node), node.get_content(), 24)
        firsts += before is None
        assert before is None or before.endswith(
            nodes[node.prev_node.node_id].get_content().strip())
        blob = engine.library.blob_for(llm_text(node))
        want = context_blob(engine, llm_text(node), before)
        assert blob.base_position == want.base_position
        torch.testing.assert_close(blob.keys, want.keys, atol=1e-5, rtol=0)
    assert firsts == 1  # only the document's first node is encoded alone
    # a node inserted later, whose previous node is already in the store
    [last] = [n for n in nodes.values() if n.next_node is None]
    late = TextNode(text="A late addendum: the ice melted in April.", id_="late")
    late.relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(node_id=last.node_id)
    index.insert_nodes([late])
    blob = engine.library.blob_for(llm_text(late))
    assert blob.base_position > engine.library.encoder.base_position
    want = context_blob(engine, llm_text(late), text_before(chain(last), "", 24) + "\n\n"
                        + last.get_content())
    torch.testing.assert_close(blob.keys, want.keys, atol=1e-5, rtol=0)


def test_nodes_are_encoded_alone_with_context_tokens_0(tmp_path, embed_model):
    from turborag_integrations.core.engine import TurboRAGEngine
    from tests.conftest import tiny_model

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", context_tokens=0,
                            progress=False)
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma")
    text = " ".join(f"Sentence number {i} says the harbour froze in year {1900 + i}."
                    for i in range(12))
    VectorStoreIndex.from_documents(
        [Document(text=text, id_="doc")], embed_model=embed_model,
        storage_context=StorageContext.from_defaults(vector_store=store),
        transformations=[SentenceSplitter(chunk_size=48, chunk_overlap=0)])
    nodes = store.get_nodes()
    assert len(nodes) > 2 and sum(n.prev_node is not None for n in nodes) > 1
    for node in nodes:
        assert engine.library.blob_for(llm_text(node)).base_position == engine.library.encoder.base_position


def test_an_llm_that_loads_its_own_engine_takes_context_tokens(model_dir, tmp_path):
    import pydantic
    import pytest

    llm = TurboRAGLLM(model_name=str(model_dir), store_path=str(tmp_path / "kv"),
                      context_tokens=8)
    assert llm._engine.library.encoder.context_tokens == 8
    assert llm._engine.fingerprint.encoding.endswith("+context:8")
    with pytest.raises(pydantic.ValidationError):
        TurboRAGLLM(model_name=str(model_dir), context_tokens=-1)


def test_ingesting_a_document_replaces_the_blobs_its_nodes_got_when_retrieved(tmp_path,
                                                                               embed_model):
    """Nodes retrieved from an index built without the wrapper get blobs encoded alone from the
    postprocessor (they have no document there); ingesting the document through the wrapper
    later gives every node after the first the blob encoded after its context, as a fresh
    ingestion would."""
    from llama_index.core.schema import NodeWithScore

    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.llama_index import KVCachePostprocessor
    from tests.conftest import tiny_model

    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", context_tokens=24,
                            progress=False)
    text = " ".join(f"Sentence number {i} says the harbour froze in year {1900 + i}."
                    for i in range(12))
    splitter = SentenceSplitter(chunk_size=48, chunk_overlap=0)
    nodes = splitter.get_nodes_from_documents([Document(text=text, id_="doc")])
    KVCachePostprocessor(engine).postprocess_nodes([NodeWithScore(node=n) for n in nodes])
    alone = engine.library.encoder.base_position
    before = {llm_text(n): engine.library.blob_for(llm_text(n)) for n in nodes}
    assert {b.base_position for b in before.values()} == {alone}

    store = KVCachingVectorStore(engine, path=tmp_path / "chroma")
    VectorStoreIndex.from_documents(
        [Document(text=text, id_="doc")], embed_model=embed_model,
        storage_context=StorageContext.from_defaults(vector_store=store),
        transformations=[splitter])
    fresh = TurboRAGEngine(engine.loaded, store=tmp_path / "kv2", context_tokens=24,
                           progress=False)
    fresh_store = KVCachingVectorStore(fresh, path=tmp_path / "chroma2")
    VectorStoreIndex.from_documents(
        [Document(text=text, id_="doc")], embed_model=embed_model,
        storage_context=StorageContext.from_defaults(vector_store=fresh_store),
        transformations=[splitter])
    positions = []
    for node in store.get_nodes():
        got, want = engine.library.blob_for(llm_text(node)), fresh.library.blob_for(llm_text(node))
        positions.append(got.base_position)
        assert got.base_position == want.base_position
        if got.base_position == alone:
            # The first node has no text before it: its blob is kept as the postprocessor
            # wrote it, not encoded again. That blob came from a batch of another width than
            # the fresh ingestion's, so the same sums ran in another order: equal to rounding.
            kept = before[llm_text(node)]
            assert torch.equal(got.keys, kept.keys) and torch.equal(got.values, kept.values)
            assert torch.allclose(got.keys, want.keys, rtol=0, atol=1e-5)
            assert torch.allclose(got.values, want.values, rtol=0, atol=1e-5)
        else:
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
    assert sorted(positions)[0] == alone < sorted(positions)[1]  # only the first is alone
