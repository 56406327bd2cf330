"""A vector store wrapper that precomputes each node's KV blob as the node is ingested.

    store = KVCachingVectorStore(engine)                    # embedded Chroma under the cache dir
    store = KVCachingVectorStore(engine, url="http://127.0.0.1:8200")   # a `chroma run` server
    index = VectorStoreIndex.from_documents(
        docs, storage_context=StorageContext.from_defaults(vector_store=store))

Ingestion is where the chunk prefill is paid, once; queries then stitch the stored blobs. The
wrapped store does all the vector work: this class only adds blob encoding (and registering the
texts for the LLM) to `add` and blob removal to `delete`, and passes everything else through.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, List, Optional, Sequence

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import BaseNode, MetadataMode
from llama_index.core.vector_stores.types import (BasePydanticVectorStore, MetadataFilters,
                                                  VectorStoreQuery, VectorStoreQueryResult)

from ..core.prefill.context import text_before
from ..core.registry import ChunkRegistry
from .nodes import KV_KEY_METADATA, hide_kv_key, llm_text
from ..core.store.namespaces import namespaced_collection
from .wiring import EngineBound

log = logging.getLogger(__name__)

DEFAULT_COLLECTION = "turborag"


def chroma_vector_store(path: str | Path | None = None, collection: str = DEFAULT_COLLECTION,
                        *, url: str | None = None):
    """A ChromaVectorStore over an embedded, persistent Chroma, or over a Chroma server.

    `url` (e.g. "http://127.0.0.1:8200", a server started with `chroma run --path DIR --port
    8200`) connects to that server: a bad URL raises ChromaURLError, no server there
    ChromaUnreachable, both saying what to do. Otherwise the embedded Chroma lives in `path`,
    default `<turborag cache>/chroma` (see `TURBORAG_CACHE`).
    """
    try:
        from llama_index.vector_stores.chroma import ChromaVectorStore
    except ImportError as exc:  # pragma: no cover - a dependency
        raise ImportError("the default vector store needs llama-index-vector-stores-chroma: "
                          "pip install llama-index-vector-stores-chroma") from exc
    from ..core.retrieval.chroma import chroma_client

    if path is None and not url:
        from ..core.environment import cache_dir

        path = cache_dir() / "chroma"
    client = chroma_client(path, url)
    return ChromaVectorStore(chroma_collection=client.get_or_create_collection(collection))


class KVCachingVectorStore(EngineBound, BasePydanticVectorStore):
    """Wraps any vector store; `add` also stores each node's KV blob, `delete` removes them.

    Without `vector_store`, it wraps the Chroma collection `collection`: on the server at `url`
    if given, else embedded in `path` (see `chroma_vector_store`).

    `namespace` (a tenant) puts the blobs in that namespace of the engine's store
    (`engine.namespaced`) and, by default, the documents in a Chroma collection of its own; give
    the LLM the same namespace.

    Each node gets metadata `turborag_kv_key` (its blob's key), excluded from LLM and embedding
    text so it never reaches a prompt or an embedding. The texts are registered, with the
    engine's fingerprint, in `registry` (None: that of a TurboRAGLLM given as `engine`, else the
    engine's, `ChunkRegistry.for_engine`), where the LLM looks for them; an LLM running another
    model then refuses them.
    """

    stores_text: bool = True
    is_embedding_query: bool = True
    show_progress: Optional[bool] = None  # None: a bar from `progress_threshold` nodes on
    progress_threshold: int = 32

    _inner: BasePydanticVectorStore = PrivateAttr()
    _engine: Any = PrivateAttr()
    _registry: ChunkRegistry = PrivateAttr()

    def __init__(self, engine=None, vector_store: BasePydanticVectorStore | None = None, *,
                 path: str | Path | None = None, url: str | None = None,
                 collection: str = DEFAULT_COLLECTION, registry: ChunkRegistry | None = None,
                 namespace: str | None = None, **kwargs: Any):
        if vector_store is not None and not isinstance(vector_store, BasePydanticVectorStore):
            raise TypeError("vector_store must be a llama_index BasePydanticVectorStore, got "
                            f"{type(vector_store).__name__}")
        if namespace is not None:
            collection = namespaced_collection(collection, namespace)
        inner = (vector_store if vector_store is not None
                 else chroma_vector_store(path, collection, url=url))
        super().__init__(stores_text=inner.stores_text,
                         is_embedding_query=inner.is_embedding_query, **kwargs)
        self._inner = inner
        self._bind(engine, registry, namespace)

    @classmethod
    def class_name(cls) -> str:
        return "KVCachingVectorStore"

    @property
    def vector_store(self) -> BasePydanticVectorStore:
        return self._inner

    @property
    def client(self) -> Any:
        return self._inner.client

    # ---- ingestion ------------------------------------------------------------------------
    def encode_nodes(self, nodes: Sequence[BaseNode]) -> List[Optional[str]]:
        """Store the blob of each node's LLM text; record its key in the node's metadata.

        Returns the keys (None for nodes without text). Blobs already stored are not encoded
        again, so re-ingesting a corpus costs only tokenization.
        """
        todo: list[tuple[int, BaseNode, str]] = []
        keys: List[Optional[str]] = [None] * len(nodes)
        for i, node in enumerate(nodes):
            hide_kv_key(node)  # first: the blob text must be what the LLM sees
            text = llm_text(node)
            if text:
                todo.append((i, node, text))
        if not todo:
            return keys
        if not self._engine.encodes_at_ingestion:
            # a hot set: the engine encodes a chunk on its k-th retrieval (core/admission.py)
            self._register([text for _, _, text in todo])
            return keys
        show = self.show_progress
        if show is None:
            show = len(todo) >= self.progress_threshold
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(todo), desc="encoding chunk KV", unit="blob")

        def progress(done: int, total: int) -> None:
            if bar is not None:  # total: a blob per chunk, and one per chunk and prompt head
                if bar.total != total:
                    bar.total = total
                    bar.refresh()
                bar.update(done - bar.n)

        try:
            stored = self._engine.encode_chunks([t for _, _, t in todo],
                                                doc_ids=[n.ref_doc_id for _, n, _ in todo],
                                                contexts=self._contexts(nodes, todo),
                                                progress=progress)
        finally:
            if bar is not None:
                bar.close()
        for (i, node, _), key in zip(todo, stored):
            node.metadata = {**node.metadata, KV_KEY_METADATA: key}
            keys[i] = key
        self._register([text for _, _, text in todo])
        return keys

    def _contexts(self, nodes: Sequence[BaseNode],
                  todo: list[tuple[int, BaseNode, str]]) -> Optional[List[Optional[str]]]:
        """The text before each node in its document, for an engine that encodes chunks after
        it (`context_tokens`): the nodes before it along their PREVIOUS relationships (node
        parsers link a document's nodes in order), from this batch or else from the wrapped
        store, as far back as the context can hold (core/prefill/context.py)."""
        tokens = self._engine.library.encoder.context_tokens
        if not tokens:
            return None
        known: dict[str, Optional[BaseNode]] = {n.node_id: n for n in nodes}

        def lookup(node_id: str) -> Optional[BaseNode]:
            if node_id not in known:
                try:
                    found = self._inner.get_nodes([node_id])
                except Exception as exc:  # a store that cannot look nodes up: no context there
                    log.debug("previous node %s not found in the wrapped store: %s", node_id, exc)
                    found = []
                known[node_id] = found[0] if found else None
            return known[node_id]

        def before(node: BaseNode):
            """The texts of the nodes before `node`, nearest first."""
            seen, link = {node.node_id}, node.prev_node
            while link is not None and link.node_id not in seen:
                seen.add(link.node_id)
                prev = lookup(link.node_id)
                if prev is None:
                    return
                yield prev.get_content(metadata_mode=MetadataMode.NONE)
                link = prev.prev_node

        return [text_before(before(node), node.get_content(metadata_mode=MetadataMode.NONE),
                            tokens) for _, node, _ in todo]

    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> List[str]:
        self.encode_nodes(nodes)
        return self._inner.add(nodes, **add_kwargs)

    async def async_add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> List[str]:
        await asyncio.to_thread(self.encode_nodes, nodes)
        return await self._inner.async_add(nodes, **kwargs)

    # ---- deletion -------------------------------------------------------------------------
    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """Delete the document's nodes, then the blobs no other document uses."""
        self._inner.delete(ref_doc_id, **delete_kwargs)
        deleted = self._engine.forget_document(ref_doc_id)
        log.debug("deleted %d KV blobs of document %s", len(deleted), ref_doc_id)

    async def adelete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        await self._inner.adelete(ref_doc_id, **delete_kwargs)
        await asyncio.to_thread(self._engine.forget_document, ref_doc_id)

    # Blobs are referenced per document, so deleting single nodes (or clearing) leaves their
    # blobs on disk: they are content-addressed and harmless, and `delete(ref_doc_id)` or a
    # store cleanup removes them.
    def delete_nodes(self, node_ids: Optional[List[str]] = None,
                     filters: Optional[MetadataFilters] = None, **delete_kwargs: Any) -> None:
        self._inner.delete_nodes(node_ids, filters, **delete_kwargs)

    async def adelete_nodes(self, node_ids: Optional[List[str]] = None,
                            filters: Optional[MetadataFilters] = None,
                            **delete_kwargs: Any) -> None:
        await self._inner.adelete_nodes(node_ids, filters, **delete_kwargs)

    def clear(self) -> None:
        self._inner.clear()

    async def aclear(self) -> None:
        await self._inner.aclear()

    # ---- everything else is the wrapped store's -----------------------------------------
    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        return self._inner.query(query, **kwargs)

    async def aquery(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        return await self._inner.aquery(query, **kwargs)

    def get_nodes(self, node_ids: Optional[List[str]] = None,
                  filters: Optional[MetadataFilters] = None) -> List[BaseNode]:
        return self._inner.get_nodes(node_ids, filters)

    async def aget_nodes(self, node_ids: Optional[List[str]] = None,
                         filters: Optional[MetadataFilters] = None) -> List[BaseNode]:
        return await self._inner.aget_nodes(node_ids, filters)

    def persist(self, persist_path: str, fs: Any = None) -> None:
        self._inner.persist(persist_path, fs=fs)
