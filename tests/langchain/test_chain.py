"""The adapters inside real LCEL chains: embedded Chroma, MiniLM embeddings, a tiny model."""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from turborag_integrations.langchain import (KV_KEY, ChunkRegistry, KVCachingVectorStore,
                                             TurboRAGChatModel, TurboRAGLLM)

from .helpers import PROMPT, format_docs, sample_paragraphs, truncate_docs

QUESTION = "When was Velmora founded, and by whom?"


@pytest.fixture
def rag(engine, minilm, tmp_path):
    registry = ChunkRegistry()
    store = KVCachingVectorStore(engine=engine, embedding=minilm,
                                 persist_directory=str(tmp_path / "chroma"), registry=registry)
    store.add_documents(sample_paragraphs(6))
    llm = TurboRAGChatModel(engine=engine, registry=registry, max_tokens=6)
    return store, llm


def chain_of(store, llm, formatter=format_docs, k=3):
    retriever = store.as_retriever(search_kwargs={"k": k})
    return ({"context": retriever | RunnableLambda(formatter), "question": RunnablePassthrough()}
            | PROMPT | llm)


def test_chain_reuses_document_kv(rag, engine):
    store, llm = rag
    docs = store.as_retriever(search_kwargs={"k": 3}).invoke(QUESTION)
    assert all(KV_KEY not in d.metadata for d in docs)  # documents come back as added
    msg = chain_of(store, llm).invoke(QUESTION)
    stats = msg.response_metadata["turborag"]
    assert stats["cache_hits"] == 3 and stats["cache_misses"] == 0
    doc_tokens = sum(len(engine.tokenizer(d.page_content, add_special_tokens=False)["input_ids"])
                     for d in docs)
    # the default recovery recomputes a few of the documents' tokens; the rest is reused
    assert stats["reused_tokens"] + stats["recomputed_tokens"] >= doc_tokens > 0
    assert stats["recomputed_tokens"] < stats["reused_tokens"]
    assert stats["prefilled_tokens"] < stats["prompt_tokens"]
    assert msg.usage_metadata["input_token_details"]["cache_read"] == stats["reused_tokens"]
    assert msg.content

    naive = chain_of(store, llm.bind(mode="naive")).invoke(QUESTION)
    assert naive.response_metadata["turborag"]["reused_tokens"] == 0
    assert naive.usage_metadata["input_tokens"] == msg.usage_metadata["input_tokens"]


def test_streaming_chain_reports_stats_on_last_chunk(rag):
    store, llm = rag
    chunks = list(chain_of(store, llm).stream(QUESTION))
    assert "".join(c.content for c in chunks)
    assert chunks[-1].chunk_position == "last"
    assert chunks[-1].response_metadata["turborag"]["reused_tokens"] > 0
    assert all("turborag" not in c.response_metadata for c in chunks[:-1])
    text = "".join((chain_of(store, llm) | StrOutputParser()).stream(QUESTION))
    assert text == "".join(c.content for c in chunks)


def test_async_stream_and_token_callbacks(rag):
    store, llm = rag

    class Tokens(BaseCallbackHandler):
        def __init__(self):
            self.tokens = []

        def on_llm_new_token(self, token, **kwargs):
            self.tokens.append(token)

    handler = Tokens()
    msg = chain_of(store, llm).invoke(QUESTION, config={"callbacks": [handler]})
    assert "".join(handler.tokens) == msg.content

    async def collect():
        return [c async for c in chain_of(store, llm).astream(QUESTION)]

    chunks = asyncio.run(collect())
    assert "".join(c.content for c in chunks) == msg.content
    assert chunks[-1].response_metadata["turborag"]["cache_hits"] == 3


def test_rewritten_documents_are_prefilled(rag, engine):
    """A formatter that truncates the documents: nothing matches, everything is prefilled,
    and the answer is exactly the full-prefill answer."""
    store, llm = rag
    msg = chain_of(store, llm, truncate_docs).invoke(QUESTION)
    stats = msg.response_metadata["turborag"]
    assert stats["cache_hits"] == 0 and stats["reused_tokens"] == 0
    assert stats["prefilled_tokens"] == stats["prompt_tokens"]
    naive = chain_of(store, llm.bind(mode="naive"), truncate_docs).invoke(QUESTION)
    assert msg.content == naive.content

    # Passed explicitly, a text the prompt does not contain is a miss, not an error.
    docs = store.similarity_search(QUESTION, k=2)
    prompt = PROMPT.invoke({"context": truncate_docs(docs), "question": QUESTION})
    msg = llm.invoke(prompt, chunks=docs)
    assert msg.response_metadata["turborag"]["cache_misses"] == 2
    assert msg.content == naive.content


def test_text_completion_llm(rag):
    store, _ = rag
    llm = TurboRAGLLM(engine=store.engine, registry=store.registry, max_tokens=6)
    prompt = PromptTemplate.from_template("Context:\n{context}\n\nQ: {question}\nA:")
    retriever = store.as_retriever(search_kwargs={"k": 2})
    chain = {"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt | llm
    assert isinstance(chain.invoke(QUESTION), str)
    result = llm.generate([prompt.format(context=format_docs(retriever.invoke(QUESTION)),
                                         question=QUESTION)])
    info = result.generations[0][0].generation_info
    assert info["turborag"]["cache_hits"] == 2 and info["turborag"]["reused_tokens"] > 0
    assert "".join(chain.stream(QUESTION))


def test_drafted_decoding_gives_the_same_answer(rag):
    """draft= (quantised drafts, full-precision verification) as a field and per call."""
    store, llm = rag
    plain = chain_of(store, llm).invoke(QUESTION).content
    drafted = chain_of(store, llm.model_copy(update={"draft": "bf16"})).invoke(QUESTION).content
    assert drafted == plain
    per_call = chain_of(store, llm.bind(draft="bf16", max_tokens=6)).invoke(QUESTION).content
    assert per_call == plain
    with pytest.raises(ValueError, match="draft must be one of"):
        llm.invoke("Hi", draft="int4")


def test_recovery_as_a_field_and_per_call(rag, engine):
    """`recovery` reaches the engine: recomputing every chunk token gives the full prefill's
    reply in an LCEL chain, and boundary:K recomputes K tokens of each of the 3 documents."""
    store, llm = rag

    def run(model):
        return chain_of(store, model).invoke(QUESTION)

    full = run(llm.bind(mode="naive", max_tokens=8))
    stitched = run(llm.bind(max_tokens=8, recovery="none"))
    everything = run(TurboRAGChatModel(engine=engine, registry=llm.registry, max_tokens=8,
                                       recovery="boundary:100000"))
    four = run(llm.bind(max_tokens=8, recovery="boundary:4"))
    stats = {name: m.response_metadata["turborag"]
             for name, m in (("stitched", stitched), ("everything", everything), ("four", four))}
    assert all(s["cache_hits"] == 3 for s in stats.values())
    assert everything.content == full.content
    # 4 tokens of each document, and of each stitched separator between them, are recomputed
    moved = stats["stitched"]["reused_tokens"] - stats["four"]["reused_tokens"]
    assert 3 * 4 <= moved <= 4 * (3 + 2)
    assert stats["four"]["prefilled_tokens"] == stats["stitched"]["prefilled_tokens"] + moved
    with pytest.raises(ValueError, match="unknown recovery 'edges:3'"):
        TurboRAGChatModel(engine=engine, recovery="edges:3")
    with pytest.raises(ValueError, match="unknown recovery 'edges:3'"):
        llm.invoke("Hi", recovery="edges:3")
