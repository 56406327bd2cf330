"""The stock query engine's prompt head: TurboRAGLLM encodes every chunk also right after it,
so the chunk the query engine puts first is stitched exactly as a full prefill computes it."""

from __future__ import annotations

import pytest
import torch
from llama_index.core import PromptTemplate, StorageContext, VectorStoreIndex
from llama_index.core.schema import TextNode

from tests.conftest import tiny_model
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.prefill.recovery import parse_recovery
from turborag_integrations.llama_index import KVCachingVectorStore, TurboRAGLLM

TEXTS = ["The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora.",
         "Visitors climb the 212 steps of the lighthouse between April and October.",
         "The Orbital Kiln Company fires ceramic tiles for satellites in a vacuum furnace."]
QUESTION = "How many steps do visitors climb in the lighthouse?"


def ask(tmp_path, embed_model, k: int, stock_head: bool):
    """Ingest TEXTS with an LLM on the engine, ask through a stock query engine; returns the
    LLM, the engine, the prompt it got and the retrieved texts."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False,
                            recovery="none")
    prompts = []
    llm = TurboRAGLLM(engine, max_new_tokens=2, stock_head=stock_head)
    render = llm.chat_prompt
    object.__setattr__(llm, "chat_prompt", lambda m: prompts.append(render(m)) or prompts[-1])
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma")
    index = VectorStoreIndex([TextNode(text=t) for t in TEXTS], embed_model=embed_model,
                             storage_context=StorageContext.from_defaults(vector_store=store))
    response = index.as_query_engine(llm=llm, similarity_top_k=k,
                                     node_postprocessors=[llm.postprocessor()]).query(QUESTION)
    return llm, engine, prompts[-1], [n.node.get_content() for n in response.source_nodes]


def logits(engine, prompt, texts, **kwargs):
    pre = engine.prefill(engine.assembly.segments(prompt, texts)[0], **kwargs)
    out = pre.logits.reshape(-1).clone()
    engine.cache_pool.release(pre.cache)
    return out


def test_one_retrieved_chunk_stitches_to_the_full_prefill(tmp_path, embed_model):
    llm, engine, prompt, texts = ask(tmp_path, embed_model, k=1, stock_head=True)
    assert len(engine.library.prompt_heads) == 1 and llm.last_stats["cache_hits"] == 1
    assert prompt.startswith(engine.tokenizer.decode(engine.library.prompt_heads[0]))
    full = logits(engine, prompt, [])
    torch.testing.assert_close(logits(engine, prompt, texts), full, atol=1e-4, rtol=0)


def test_without_the_stock_head_the_first_chunk_is_not_exact(tmp_path, embed_model):
    llm, engine, prompt, texts = ask(tmp_path, embed_model, k=1, stock_head=False)
    assert engine.library.prompt_heads == [] and llm.last_stats["cache_hits"] == 1
    assert (logits(engine, prompt, texts) - logits(engine, prompt, [])).abs().max() > 1e-3


def test_every_chunk_gets_its_lead_blob_at_ingestion(tmp_path, embed_model):
    llm, engine, prompt, texts = ask(tmp_path, embed_model, k=3, stock_head=True)
    leads = [k for k in engine.store.keys() if engine.library.is_lead(engine.store.get(k))]
    assert len(leads) == len(TEXTS)
    # three chunks: the first is exact, as recomputing it would make it
    recomputed = logits(TurboRAGEngine(engine.loaded, store=engine.store,
                                       recovery="none"), prompt, texts,
                        recovery=parse_recovery("first"))
    torch.testing.assert_close(logits(engine, prompt, texts), recomputed, atol=1e-4, rtol=0)


def test_add_prompt_takes_other_templates_and_refuses_what_cannot_have_a_head(tmp_path):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False,
                            recovery="none")
    llm = TurboRAGLLM(engine, stock_head=False)
    head = llm.add_prompt(PromptTemplate("Read:\n{context_str}\nQ: {query_str}\nA:"))
    assert head.endswith("Read:\n") and len(engine.library.prompt_heads) == 1
    with pytest.raises(ValueError, match="no {context_str}"):
        llm.add_prompt(PromptTemplate("Q: {query_str}\nA:"))
    with pytest.raises(ValueError, match="before the context"):
        llm.add_prompt(PromptTemplate("Q: {query_str}\nRead:\n{context_str}\nA:"))


def test_the_ingestion_bar_counts_the_lead_blobs(tmp_path, capsys):
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False,
                            recovery="none")
    TurboRAGLLM(engine, stock_head=True)  # registers the stock head
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma", show_progress=True)
    store.add([TextNode(text=t, embedding=[float(i), 1.0, 0.0]) for i, t in enumerate(TEXTS)])
    assert "6/6" in capsys.readouterr().err  # three chunks, each with its lead blob


def test_a_hot_set_index_stores_nothing_at_ingestion_and_the_kth_query_encodes(tmp_path,
                                                                              embed_model):
    """A stock LlamaIndex pipeline over an engine with `admit_after=2`: inserting nodes writes
    no blob; the second query that retrieves a node queues its encoding (with its lead blob),
    and the third stitches it."""
    engine = TurboRAGEngine(tiny_model("llama"), store=tmp_path / "kv", progress=False,
                            recovery="none", admit_after=2)
    llm = TurboRAGLLM(engine, max_new_tokens=2)
    store = KVCachingVectorStore(engine, path=tmp_path / "chroma")
    index = VectorStoreIndex([TextNode(text=t) for t in TEXTS], embed_model=embed_model,
                             storage_context=StorageContext.from_defaults(vector_store=store))
    assert engine.store.stats().writes == 0
    query = index.as_query_engine(llm=llm, similarity_top_k=1,
                                  node_postprocessors=[llm.postprocessor()])
    for _ in range(2):
        query.query(QUESTION)
        assert llm.last_stats["cache_hits"] == 0 and llm.last_stats["cache_misses"] == 1
    assert engine.admission.drain(30) and engine.admission.stats.encoded == 1
    query.query(QUESTION)
    assert llm.last_stats["cache_hits"] == 1
    assert any(engine.library.is_lead(engine.store.get(k)) for k in engine.store.keys())
    engine.close()
