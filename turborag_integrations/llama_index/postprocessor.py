"""After retrieval: make sure each retrieved node has its KV blob, warm, and tell the LLM.

Put it last in `node_postprocessors` (after rerankers and filters): it must see the nodes that
really reach the prompt. Nodes ingested without `KVCachingVectorStore` (or before it existed)
get their blob computed here, once; later queries reuse it. The blob work is the engine's
(`engine.library.prepare_chunks`); this class reads the nodes' texts, warns about stale ones and
registers the texts for the LLM.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from ..core.registry import ChunkRegistry
from .nodes import KV_KEY_METADATA, llm_text
from .wiring import EngineBound

log = logging.getLogger(__name__)


class KVCachePostprocessor(EngineBound, BaseNodePostprocessor):
    """Pass nodes through unchanged; as a side effect their blobs are ready for the LLM.

    encode_missing: compute the blob of a node that has none (a node ingested without the
        wrapper, or whose text changed since). False leaves such nodes to be prefilled, and the
        LLM's `cache_misses` counts them.
    registry: where the texts are recorded for the LLM (None: that of a TurboRAGLLM given as
        `engine`, else the engine's, `ChunkRegistry.for_engine`).
    """

    encode_missing: bool = True

    _engine: Any = PrivateAttr()
    _registry: ChunkRegistry = PrivateAttr()

    def __init__(self, engine=None, registry: ChunkRegistry | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._bind(engine, registry)

    @classmethod
    def class_name(cls) -> str:
        return "KVCachePostprocessor"

    def _postprocess_nodes(self, nodes: List[NodeWithScore],
                           query_bundle: Optional[QueryBundle] = None) -> List[NodeWithScore]:
        nodes_and_texts = [(n.node, llm_text(n.node)) for n in nodes]
        nodes_and_texts = [(node, text) for node, text in nodes_and_texts if text]
        texts = [text for _, text in nodes_and_texts]
        # a hot set encodes a chunk on its k-th retrieval, in the background (core/admission.py)
        encode = self.encode_missing and self._engine.encodes_at_ingestion
        keys = self._engine.library.prepare_chunks(
            texts, doc_ids=[node.ref_doc_id for node, _ in nodes_and_texts],
            encode_missing=encode)
        for (node, _), key in zip(nodes_and_texts, keys):
            recorded = node.metadata.get(KV_KEY_METADATA)
            if not recorded or recorded == key:
                continue
            if encode:
                log.warning("node %s changed since ingestion (its blob %s is stale); encoding "
                            "its new text", node.node_id, recorded)
            else:
                log.warning("node %s has no blob for its current text (the recorded blob %s is "
                            "stale or gone); it will be prefilled", node.node_id, recorded)
        self._register([t for t, key in zip(texts, keys) if key])
        self._register([t for t, key in zip(texts, keys) if not key], prepared=False)
        return nodes
