"""A node postprocessor that puts retrieved nodes back in their documents' order.

    qe = index.as_query_engine(llm=llm, node_postprocessors=[
        DocumentOrderPostprocessor(), llm.postprocessor()])

Node parsers set what it needs: each node's document (`ref_doc_id`) and its start in it
(`start_char_idx`). Why the order matters to stitched prompts: core/retrieval/order.py.
"""

from __future__ import annotations

from typing import List, Optional

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from ..core.retrieval.order import document_order


class DocumentOrderPostprocessor(BaseNodePostprocessor):
    """Reorder nodes: each document's nodes together, where its best-scored node was, in their
    order in the document. The nodes themselves (scores included) are unchanged; nodes without
    a document keep their place."""

    @classmethod
    def class_name(cls) -> str:
        return "DocumentOrderPostprocessor"

    def _postprocess_nodes(self, nodes: List[NodeWithScore],
                           query_bundle: Optional[QueryBundle] = None) -> List[NodeWithScore]:
        keys = [(n.node.ref_doc_id, n.node.start_char_idx) for n in nodes]
        return [nodes[i] for i in document_order(keys)]
