"""TurboRAG for LlamaIndex: precomputed chunk KV caches behind the stock query and chat engines.

    engine = TurboRAGEngine()
    store = KVCachingVectorStore(engine)                  # blobs computed at ingestion
    index = VectorStoreIndex.from_documents(docs, storage_context=
                StorageContext.from_defaults(vector_store=store), embed_model=...)
    llm = TurboRAGLLM(engine)
    qe = index.as_query_engine(llm=llm, node_postprocessors=[KVCachePostprocessor(engine)])

Needs llama-index-core (and llama-index-vector-stores-chroma for the default store).
"""

from ..core.registry import ChunkRegistry
from .llm import STATS_KEY, TurboRAGLLM, stats_payload
from .nodes import KV_KEY_METADATA, llm_text
from .order import DocumentOrderPostprocessor
from .postprocessor import KVCachePostprocessor
from .vector_store import KVCachingVectorStore, chroma_vector_store
from .rapid import RapidLLM

__all__ = ["TurboRAGLLM", "KVCachingVectorStore", "KVCachePostprocessor", "DocumentOrderPostprocessor",
           "ChunkRegistry",
           "chroma_vector_store", "llm_text", "KV_KEY_METADATA", "STATS_KEY", "stats_payload", "RapidLLM"]
