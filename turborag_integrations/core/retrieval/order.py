"""Retrieved chunks put back in their documents' order.

A retriever returns chunks by score. A stitched chunk was encoded after its own document's text
before it (prefill/context.py), so it behaves most like the full prefill's chunk when the prompt
puts before it what its document did: the chunks of one document together and in their order.
Order-preserving RAG (OP-RAG, arXiv 2409.01666) recommends the same order for a full prefill's
answers; for the bundled 135M model it cost some (docs/accuracy.md).

The adapters supply each chunk's document and position (LlamaIndex: `ref_doc_id` and
`start_char_idx`; LangChain: metadata "source" and "start_index"); this module only orders.
"""

from __future__ import annotations

from typing import Hashable, Sequence

__all__ = ["document_order"]


def document_order(keys: Sequence[tuple[Hashable | None, int | None]]) -> list[int]:
    """The indices of `keys` — one (document, position in it) per chunk, in retrieval order —
    reordered so that each document's chunks come together, where its best-ranked chunk was
    retrieved, in the order of their positions.

    A chunk without a document is a group of its own and stays in its place among the groups.
    A document some of whose chunks lack a position keeps its chunks in retrieval order: their
    order in the document is not known.
    """
    groups: dict[object, list[int]] = {}
    for i, (document, _) in enumerate(keys):
        groups.setdefault(("doc", document) if document is not None else ("alone", i), []).append(i)
    order: list[int] = []
    for members in groups.values():
        positions = [keys[i][1] for i in members]
        if all(isinstance(p, int) and not isinstance(p, bool) for p in positions):
            members = sorted(members, key=lambda i: keys[i][1])  # stable: ties keep their rank
        order.extend(members)
    return order
