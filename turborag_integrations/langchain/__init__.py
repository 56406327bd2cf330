"""LangChain adapters for TurboRAG: a KV-caching vector store wrapper and chat/LLM models.

    engine = TurboRAGEngine()
    store = KVCachingVectorStore(engine=engine, persist_directory="./db")
    store.add_documents(docs)                      # embeds and encodes KV blobs
    llm = TurboRAGChatModel(engine=engine)         # reuses those blobs inside any prompt
    chain = store.as_retriever() | format_docs | prompt | llm | StrOutputParser()

Importing this package imports langchain-core (and langchain-chroma when the default store is
built); the core engine does not need either.
"""

from ..core.errors import FingerprintMismatch
from ..core.registry import ChunkRegistry
from ..core.shared import shared_engine
from .callbacks import TurboRAGRunCollector
from .chat_model import TurboRAGChatModel
from .embeddings import SentenceTransformerEmbeddings
from .fingerprints import FINGERPRINT, KV_KEY, MODEL
from .llm import TurboRAGLLM
from .order import in_document_order
from .vectorstore import KVCachingVectorStore
from .rapid import RapidChatModel

__all__ = ["KVCachingVectorStore", "TurboRAGChatModel", "TurboRAGLLM", "TurboRAGRunCollector",
           "ChunkRegistry", "SentenceTransformerEmbeddings", "shared_engine",
           "FingerprintMismatch", "KV_KEY", "FINGERPRINT", "MODEL", "RapidChatModel",
           "in_document_order"]
