"""in_document_order in an LCEL chain: retrieved pieces come back in their source's order (by
"start_index"), each source's together, and reach the chat model as cache hits."""

from __future__ import annotations

from langchain_core.documents import Document
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from turborag_integrations.langchain import (KVCachingVectorStore, TurboRAGChatModel,
                                             in_document_order)

from .helpers import PROMPT, format_docs

LIGHTHOUSE = [
    "The Tall Widow lighthouse stands 41 metres high on the cliffs of Velmora.",
    "It was first lit in 1871, and its lamp burned whale oil until 1923.",
    "The keeper's cottage below the tower became a museum of shipwrecks in 1962.",
    "Visitors climb the 212 steps of the lighthouse between April and October.",
]
QUESTION = "How many steps do visitors climb in the lighthouse?"


def pieces(source: str, texts: list[str], start_index: bool = True) -> list[Document]:
    """A document's pieces as a text splitter with `add_start_index=True` returns them."""
    out, start = [], 0
    for text in texts:
        metadata = {"source": source, **({"start_index": start} if start_index else {})}
        out.append(Document(page_content=text, metadata=metadata))
        start += len(text) + 2
    return out


def test_pieces_are_regrouped_by_source_in_start_index_order():
    a, b = pieces("a.md", ["a0", "a1", "a2"]), pieces("b.md", ["b0", "b1"])
    ranked = [a[2], b[1], a[0], b[0], a[1]]
    assert in_document_order(ranked) == [a[0], a[1], a[2], b[0], b[1]]
    loose = Document(page_content="no source")
    assert in_document_order([loose, b[1], b[0]]) == [loose, b[0], b[1]]
    # without "start_index" the order in the source is unknown: retrieval order stays
    unplaced = pieces("c.md", ["c0", "c1"], start_index=False)
    assert in_document_order([unplaced[1], unplaced[0]]) == [unplaced[1], unplaced[0]]


def test_a_chain_retrieves_in_score_order_and_prompts_in_document_order(engine, minilm, tmp_path):
    store = KVCachingVectorStore(engine=engine, embedding=minilm,
                                 persist_directory=str(tmp_path / "chroma"))
    store.add_documents(pieces("lighthouse.md", LIGHTHOUSE)
                        + pieces("kiln.md", ["The Orbital Kiln Company fires ceramic tiles."]))
    retriever = store.as_retriever(search_kwargs={"k": len(LIGHTHOUSE)})
    ranked = [d.page_content for d in retriever.invoke(QUESTION)]
    assert sorted(ranked) == sorted(LIGHTHOUSE) and ranked != LIGHTHOUSE

    contexts = []

    def formatted(docs):
        contexts.append(format_docs(docs))
        return contexts[-1]

    chain = ({"context": retriever | in_document_order | RunnableLambda(formatted),
              "question": RunnablePassthrough()}
             | PROMPT | TurboRAGChatModel(engine=engine, max_tokens=4))
    message = chain.invoke(QUESTION)
    assert contexts == ["\n\n".join(LIGHTHOUSE)]
    stats = message.response_metadata["turborag"]
    assert stats["cache_hits"] == len(LIGHTHOUSE) and stats["cache_misses"] == 0
