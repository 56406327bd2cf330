"""KVCachingVectorStore bookkeeping: blobs follow documents; stale, foreign blobs are not used."""

from __future__ import annotations

import pytest
import torch
from langchain_core.documents import Document
from langchain_core.vectorstores import InMemoryVectorStore

from tests.conftest import tiny_model
from tests.langchain.conftest import cached_tiny_engine
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.langchain import (FINGERPRINT, KV_KEY, ChunkRegistry,
                                             FingerprintMismatch, KVCachingVectorStore,
                                             TurboRAGChatModel)

from .helpers import PROMPT, format_docs, sample_paragraphs

QUESTION = "What does Velmora produce?"


def make_store(engine, minilm, tmp_path, **kwargs):
    return KVCachingVectorStore(engine=engine, embedding=minilm,
                                persist_directory=str(tmp_path / "chroma"),
                                registry=kwargs.pop("registry", ChunkRegistry()), **kwargs)


def prompt_for(docs):
    return PROMPT.invoke({"context": format_docs(docs), "question": QUESTION})


def test_metadata_blobs_and_delete(engine, minilm, tmp_path):
    store = make_store(engine, minilm, tmp_path, turborag_metadata=True)
    docs = sample_paragraphs(3)
    ids = store.add_documents(docs, ids=["a", "b", "c"])
    assert ids == ["a", "b", "c"]
    for doc in store.get_by_ids(ids):
        assert doc.metadata[KV_KEY] == engine.library.chunk_key(doc.page_content)
        assert doc.metadata[FINGERPRINT] == engine.fingerprint.id
        assert engine.store.contains(doc.metadata[KV_KEY])
    assert docs[0].metadata == {"source": docs[0].metadata["source"]}  # inputs not mutated
    key_a = engine.library.chunk_key(docs[0].page_content)
    store.delete(["a"])
    assert not engine.store.contains(key_a)
    assert engine.store.contains(engine.library.chunk_key(docs[1].page_content))


def test_shared_text_keeps_its_blob_until_the_last_document_goes(engine, minilm, tmp_path):
    store = make_store(engine, minilm, tmp_path)
    text = sample_paragraphs(1)[0].page_content
    store.add_texts([text, text], ids=["x", "y"])
    key = engine.library.chunk_key(text)
    store.delete(["x"])
    assert engine.store.contains(key)
    store.delete(["y"])
    assert not engine.store.contains(key)


def test_document_replaced_through_the_wrapper(engine, minilm, tmp_path):
    """Re-adding an id with edited text drops the old blob and encodes the new text."""
    registry = ChunkRegistry()
    store = make_store(engine, minilm, tmp_path, registry=registry)
    docs = sample_paragraphs(3)
    store.add_documents(docs, ids=["a", "b", "c"])
    old = docs[0].page_content
    new = old.replace(" the ", " THE ", 1)
    assert new != old
    store.add_documents([Document(page_content=new, metadata=docs[0].metadata)], ids=["a"])
    assert not engine.store.contains(engine.library.chunk_key(old))
    assert engine.store.contains(engine.library.chunk_key(new))
    assert old not in registry

    llm = TurboRAGChatModel(engine=engine, registry=registry, max_tokens=4)
    stats = llm.invoke(prompt_for(store.get_by_ids(["a", "b"]))).response_metadata["turborag"]
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0
    # A prompt still holding the old text (e.g. from an earlier retrieval) cannot use it.
    before = [Document(page_content=old), *store.get_by_ids(["b"])]
    stats = llm.invoke(prompt_for(before), chunks=[old]).response_metadata["turborag"]
    assert stats["cache_misses"] == 1 and stats["cache_hits"] == 1


def test_document_edited_behind_the_wrappers_back(engine, minilm, tmp_path):
    """The wrapped store is updated directly: the metadata still names the old blob, but blobs
    are looked up by content, so the edited text is prefilled, exactly."""
    registry = ChunkRegistry()
    store = make_store(engine, minilm, tmp_path, registry=registry)
    docs = sample_paragraphs(3)
    store.add_documents(docs, ids=["a", "b", "c"])
    stale = store.vectorstore.get_by_ids(["a"])[0]
    edited = stale.page_content.replace(" the ", " THE ", 1)
    store.vectorstore.add_documents([Document(page_content=edited, metadata=stale.metadata)],
                                    ids=["a"])
    retrieved = store.get_by_ids(["a", "b"])
    assert retrieved[0].page_content == edited != stale.page_content

    llm = TurboRAGChatModel(engine=engine, registry=registry, max_tokens=6)
    msg = llm.invoke(prompt_for(retrieved))
    stats = msg.response_metadata["turborag"]
    assert stats["cache_hits"] == 1 and stats["cache_misses"] == 1
    # Same tokens as a generation told only about the unchanged document: the stale blob
    # played no part.
    prompt = llm.render(prompt_for(retrieved).to_messages())
    expected = engine.generate(prompt, chunks=[retrieved[1].page_content],
                               config=llm.generation_config(None, {}))
    assert msg.content == expected.text
    edited_tokens = len(engine.tokenizer(edited, add_special_tokens=False)["input_ids"])
    assert stats["prefilled_tokens"] >= edited_tokens


def test_wrong_model_for_a_chroma_store_fails_on_construction(engine, minilm, tmp_path):
    store = make_store(engine, minilm, tmp_path)
    store.vectorstore.add_texts(["added around the wrapper: no fingerprint"])
    store.add_documents(sample_paragraphs(2))
    other = TurboRAGEngine(tiny_model("llama", seed=1), store=str(tmp_path / "kv"),
                           progress=False)
    with pytest.raises(FingerprintMismatch) as err:
        make_store(other, minilm, tmp_path)
    message = str(err.value)
    assert engine.fingerprint.id in message and other.fingerprint.id in message


def test_wrong_model_fails_on_retrieval_and_in_the_chat_model(engine, minilm, tmp_path):
    """A store without Chroma's `get` cannot be pre-checked: retrieval raises instead. And a
    chat model that meets documents ingested for another model says so."""
    registry = ChunkRegistry()
    inner = InMemoryVectorStore(minilm)
    KVCachingVectorStore(inner, engine=engine, registry=registry).add_documents(
        sample_paragraphs(2))
    other = TurboRAGEngine(tiny_model("llama", seed=1), store=str(tmp_path / "kv2"),
                           progress=False)
    wrong = KVCachingVectorStore(inner, engine=other, registry=ChunkRegistry())
    with pytest.raises(FingerprintMismatch, match=other.fingerprint.id) as err:
        wrong.similarity_search(QUESTION)
    assert engine.fingerprint.id in str(err.value)

    docs = KVCachingVectorStore(inner, engine=engine, registry=registry).similarity_search(
        QUESTION, k=2)
    llm = TurboRAGChatModel(engine=other, registry=registry, max_tokens=2)
    with pytest.raises(FingerprintMismatch) as err:
        llm.invoke(prompt_for(docs))
    assert engine.fingerprint.id in str(err.value) and other.fingerprint.id in str(err.value)
    # Opting out of the check: the foreign blobs are simply not used.
    llm = TurboRAGChatModel(engine=other, registry=registry, max_tokens=2,
                            check_fingerprint=False)
    stats = llm.invoke(prompt_for(docs)).response_metadata["turborag"]
    assert stats["cache_hits"] == 0 and stats["cache_misses"] == 2


def test_registry_bounds():
    registry = ChunkRegistry(capacity=2, min_chars=5)
    registry.add("foo")  # too short to be worth a lookup
    assert len(registry) == 0
    for text in ("alpha alpha", "bravo bravo", "charlie charlie"):
        registry.add(text)
    assert "alpha alpha" not in registry and len(registry) == 2
    assert [e.text for e in registry.entries_in("x charlie charlie bravo bravo")] == [
        "charlie charlie", "bravo bravo"]


def test_adapters_on_one_engine_share_its_registry(engine, minilm):
    from turborag_integrations.langchain import TurboRAGLLM

    shared = ChunkRegistry.for_engine(engine)
    store = KVCachingVectorStore(InMemoryVectorStore(minilm), engine=engine)
    assert store.registry is shared
    assert TurboRAGChatModel(engine=engine).get_registry() is shared
    assert TurboRAGLLM(engine=engine).get_registry() is shared


def test_from_documents_builds_chroma_and_encodes(engine, minilm, tmp_path):
    docs = sample_paragraphs(2)
    store = KVCachingVectorStore.from_documents(
        docs, minilm, engine=engine, persist_directory=str(tmp_path / "chroma"),
        registry=ChunkRegistry(), turborag_metadata=True)
    found = store.similarity_search(docs[1].page_content, k=1)[0]
    assert found.page_content == docs[1].page_content
    assert engine.store.contains(found.metadata[KV_KEY])
    assert docs[1].page_content in store.registry


def test_tenants_on_one_engine_keep_their_documents_and_blobs_apart(engine, minilm, tmp_path):
    from turborag_integrations.langchain import KVCachingVectorStore, TurboRAGChatModel

    docs = sample_paragraphs(4)
    stores = {t: KVCachingVectorStore(engine=engine, embedding=minilm, namespace=t,
                                      persist_directory=str(tmp_path / "chroma"))
              for t in ("acme", "globex")}
    stores["acme"].add_documents(docs[:2])
    stores["globex"].add_documents(docs[2:])
    found = stores["globex"].similarity_search(docs[0].page_content, k=4)
    assert {d.page_content for d in found} == {d.page_content for d in docs[2:]}
    a = TurboRAGChatModel(engine=engine, namespace="acme", max_tokens=2)
    b = TurboRAGChatModel(engine=engine, namespace="globex", max_tokens=2)
    assert a.invoke(prompt_for(docs[:2])).response_metadata["turborag"]["cache_hits"] == 2
    assert b.invoke(prompt_for(docs[:2])).response_metadata["turborag"]["reused_tokens"] == 0


def test_pieces_of_one_source_are_encoded_after_the_piece_before(minilm, tmp_path):
    """With `context_tokens`, a text is encoded after the texts before it in the same call with
    the same metadata "source" (a splitter's pieces of one document, in order); a text without
    a source, or a source's first piece, alone."""
    from turborag_integrations.langchain.vectorstore import _contexts

    base = cached_tiny_engine(0)
    engine = TurboRAGEngine(base.loaded, store=str(tmp_path / "kv"), context_tokens=16,
                            progress=False)
    texts = ["Velmora sits on a frozen harbour.", "Orbital Kiln fires tiles.",
             "Its ferry stops in January.", "A note with no source.", "Kiln tiles go to orbit."]
    metas = [{"source": "velmora.md"}, {"source": "kiln.md"}, {"source": "velmora.md"}, {},
             {"source": "kiln.md"}]
    assert _contexts(texts, metas, 16) == [None, None, texts[0], None, texts[1]]
    assert _contexts(texts, None, 16) == _contexts(texts, metas, 0) == [None] * len(texts)
    more = ["A third piece of velmora.md, on the lighthouse."]
    assert _contexts(texts + more, metas + [{"source": "velmora.md"}], 16)[-1] == \
        texts[0] + "\n\n" + texts[2]  # every piece before it, as far as the context holds
    store = make_store(engine, minilm, tmp_path)
    store.add_texts(texts, metadatas=metas)
    enc = engine.library.encoder
    for text, before in zip(texts, _contexts(texts, metas, 16)):
        ids = enc.tokenize(text)
        want = enc.encode_ids([ids], contexts=[enc.context_ids(before, len(ids))])[0]
        blob = engine.library.blob_for(text)
        assert blob.base_position == want.base_position
        torch.testing.assert_close(blob.values, want.values, atol=1e-5, rtol=0)
    assert engine.library.blob_for(texts[2]).base_position > enc.base_position
