"""After retrieval: make sure each retrieved node has its KV blob, warm, and tell the LLM.

Put it last in `node_postprocessors` (after rerankers and filters): it must see the nodes that
really reach the prompt. Nodes ingested without `KVCachingVectorStore` (or before it existed)
get their blob computed here, once; later queries reuse it.
"""

from __future__ import annotations

import logging
from typing import Any, List, Optional

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, QueryBundle

from ..core.errors import EmptyChunkError
from .nodes import KV_KEY_METADATA, llm_text
from .registry import ChunkRegistry
from .vector_store import resolve_engine

log = logging.getLogger(__name__)


class KVCachePostprocessor(BaseNodePostprocessor):
    """Pass nodes through unchanged; as a side effect their blobs are ready for the LLM.

    encode_missing: compute the blob of a node that has none (a node ingested without the
        wrapper, or whose text changed since). False leaves such nodes to be prefilled, and the
        LLM's `cache_misses` counts them.
    """

    encode_missing: bool = True

    _engine: Any = PrivateAttr()
    _registry: ChunkRegistry = PrivateAttr()

    def __init__(self, engine=None, registry: ChunkRegistry | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._engine = resolve_engine(engine)
        if registry is None:
            registry = getattr(engine, "registry", None)  # a TurboRAGLLM brings its registry
        self._registry = registry if registry is not None else ChunkRegistry.for_engine(
            self._engine)

    @classmethod
    def class_name(cls) -> str:
        return "KVCachePostprocessor"

    @property
    def engine(self):
        return self._engine

    @property
    def registry(self) -> ChunkRegistry:
        return self._registry

    def _postprocess_nodes(self, nodes: List[NodeWithScore],
                           query_bundle: Optional[QueryBundle] = None) -> List[NodeWithScore]:
        engine, store = self._engine, self._engine.store
        texts, keys, missing, missing_docs = [], [], [], []
        for n in nodes:
            text = llm_text(n.node)
            if not text:
                continue
            try:
                key = engine.chunk_key(text)
            except EmptyChunkError:
                continue
            recorded = n.node.metadata.get(KV_KEY_METADATA)
            if recorded and recorded != key:
                log.warning("node %s changed since ingestion (its blob %s is stale)%s",
                            n.node.node_id, recorded,
                            "; encoding its new text" if self.encode_missing else
                            "; it will be prefilled")
            texts.append(text)
            if store.contains(key):
                keys.append(key)
            elif self.encode_missing:
                missing.append(text)
                missing_docs.append(n.node.ref_doc_id)
        if missing:
            keys.extend(engine.encode_chunks(missing, doc_ids=missing_docs))
        for key in keys:
            store.get(key, engine.fingerprint)  # disk → memory tier, ahead of the LLM call
        self._registry.add(texts)
        return nodes
