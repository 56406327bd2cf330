"""TurboRAGChatModel.add_prompt: chunks are encoded also right after an LCEL prompt's head,
so the document a chain puts first is stitched exactly as a full prefill computes it."""

from __future__ import annotations

import pytest
import torch
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough

from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.langchain import KVCachingVectorStore, TurboRAGChatModel

from .helpers import PROMPT, format_docs

TEXTS = ["The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora.",
         "Visitors climb the 212 steps of the lighthouse between April and October."]
QUESTION = "How many steps do visitors climb in the lighthouse?"


def test_a_chain_stitches_its_first_document_from_the_lead_blob(engine, minilm, tmp_path):
    model = TurboRAGChatModel(engine=engine, max_tokens=2)
    head = model.add_prompt(PROMPT)
    assert head == engine.assembly.prompt_head(model.render(PROMPT.format_messages(
        context="\x00TURBORAG-CONTEXT\x00", question="?")))
    store = KVCachingVectorStore(engine=engine, embedding=minilm,
                                 persist_directory=str(tmp_path / "chroma"))
    store.add_texts(TEXTS)
    assert len(engine.store.keys()) == 2 * len(TEXTS)  # each chunk's blob and its lead blob
    retriever = store.as_retriever(search_kwargs={"k": 1})
    context = {"context": retriever | format_docs, "question": RunnablePassthrough()}
    reply = (context | PROMPT | model).invoke(QUESTION)
    assert reply.response_metadata["turborag"]["lead_blob"] is True

    [doc] = retriever.invoke(QUESTION)
    prompt = model.render(PROMPT.format_messages(context=doc.page_content, question=QUESTION))
    out = {}
    for mode in ("turbo", "naive"):
        pre = engine.prefill(engine.assembly.segments(prompt, [doc.page_content] if mode == "turbo" else ())[0])
        out[mode] = pre.logits.reshape(-1).clone()
        engine.cache_pool.release(pre.cache)
    torch.testing.assert_close(out["turbo"], out["naive"], atol=1e-4, rtol=0)


def test_question_first_prompts_need_question_last(engine, tmp_path):
    question_first = ChatPromptTemplate.from_messages([
        ("system", "Answer briefly."), ("human", "Question: {question}\nContext: {context}\nAnswer:")])
    with pytest.raises(ValueError, match="question_last=True"):
        TurboRAGChatModel(engine=engine).add_prompt(question_first)
    turned = TurboRAGEngine(engine.loaded, store=str(tmp_path / "kv2"), question_last=True)
    head = TurboRAGChatModel(engine=turned).add_prompt(question_first)
    assert "Question" not in head and len(turned.library.prompt_heads) == 1
    with pytest.raises(ValueError, match="no {context}"):
        TurboRAGChatModel(engine=turned).add_prompt(ChatPromptTemplate.from_template("{q}"))


def test_a_string_llm_registers_the_text_before_its_context(engine):
    from langchain_core.prompts import PromptTemplate

    from turborag_integrations.langchain import TurboRAGLLM

    head = TurboRAGLLM(engine=engine).add_prompt(
        PromptTemplate.from_template("Use the context.\n{context}\nQ: {question}\nA:"))
    assert head == "Use the context.\n" and len(engine.library.prompt_heads) == 1
