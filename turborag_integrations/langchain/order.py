"""Retrieved documents put back in their source documents' order, for an LCEL chain:

    context = store.as_retriever(search_kwargs={"k": 6}) | in_document_order | format_docs

It reads metadata "source" (loaders set it) and "start_index" (text splitters set it with
`add_start_index=True`). Why the order matters to stitched prompts: core/retrieval/order.py.
"""

from __future__ import annotations

from typing import Sequence

from langchain_core.documents import Document

from ..core.retrieval.order import document_order


def in_document_order(docs: Sequence[Document]) -> list[Document]:
    """`docs` reordered: each source's pieces together, where its best-ranked piece was, in the
    order of their "start_index". Pieces without a "source" keep their place; a source some of
    whose pieces lack a "start_index" keeps retrieval order."""
    keys = []
    for doc in docs:
        metadata = doc.metadata or {}
        source = metadata.get("source")
        keys.append((source if isinstance(source, (str, int)) else None,
                     metadata.get("start_index")))
    return [docs[i] for i in document_order(keys)]
