"""KVCachingVectorStore: any LangChain vector store, plus a KV blob per document.

Documents are encoded with the engine's model when they are added, so that a later prompt that
contains them prefills only the question. Search is the wrapped store's; what the wrapper adds on
the way out is bookkeeping: every document it returns is registered as a text the chat model
should look for, and checked for having been ingested with the engine's model.

    store = KVCachingVectorStore(engine=engine, persist_directory="./db")   # embedded Chroma
    store = KVCachingVectorStore(engine=engine, chroma_url="http://127.0.0.1:8200")  # a server
    store.add_documents(docs)
    chain = store.as_retriever() | format_docs | prompt | TurboRAGChatModel(engine=engine)

Blobs are reference-counted per document id (the vector store's ids): deleting or replacing a
document drops the blob unless another document has the same text.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.vectorstores import VectorStore

from ..core.models import ModelConfig
from ..core.engine import TurboRAGEngine
from ..core.prefill.context import text_before
from ..core.registry import ChunkRegistry
from .fingerprints import FINGERPRINT, KV_KEY, METADATA_KEYS, MODEL, check_metadata
from ..core.store.namespaces import namespaced_collection
from ..core.shared import shared_engine

log = logging.getLogger(__name__)

_PRECHECK_PAGE = 256
_PRECHECK_LIMIT = 4096  # documents without our metadata scanned at most, on construction


@dataclass(frozen=True)
class DefaultChroma:
    """The Chroma collection the wrapper makes when given no store: on the Chroma server at
    `chroma_url`, over the chromadb client `chroma_client`, embedded in `persist_directory`, or
    (none of them) in memory; `embedding` None: the bundled MiniLM embeddings."""

    embedding: Embeddings | None = None
    persist_directory: str | None = None
    collection_name: str = "turborag"
    chroma_url: str | None = None
    chroma_client: Any = None

    def __post_init__(self) -> None:
        if self.chroma_url and self.chroma_client is not None:
            raise ValueError("give chroma_url or chroma_client, not both")
        if self.persist_directory and (self.chroma_url or self.chroma_client is not None):
            # Chroma would silently prefer the client: say it instead.
            raise ValueError("persist_directory is for the embedded Chroma; a Chroma server "
                             "keeps its own files (`chroma run --path DIR`): drop one of them")

    def build(self, namespace: str | None) -> VectorStore:
        from langchain_chroma import Chroma

        client = self.chroma_client
        if self.chroma_url:
            from ..core.retrieval.chroma import chroma_client as connect

            client = connect(url=self.chroma_url)  # fails here, saying what to do, if none answers
        embedding = self.embedding
        if embedding is None:
            from .embeddings import SentenceTransformerEmbeddings

            embedding = SentenceTransformerEmbeddings()
        name = (self.collection_name if namespace is None
                else namespaced_collection(self.collection_name, namespace))
        return Chroma(collection_name=name, embedding_function=embedding,
                      persist_directory=str(self.persist_directory) if self.persist_directory
                      else None, client=client)


# What the wrapper builds for the parts it is not given, by keyword: the shared engine of a
# model, and the default Chroma collection.
_ENGINE_OPTIONS = {"model", "device", "dtype", "model_kwargs", "tokenizer_kwargs"}
_CHROMA_OPTIONS = {f.name for f in dataclasses.fields(DefaultChroma)}


def _contexts(texts: Sequence[str], metadatas: list[dict] | None,
              context_tokens: int) -> list[str | None]:
    """The text before each one in its document, for an engine that encodes chunks after it
    (`context_tokens`): the texts before it in the same call with the same metadata "source"
    (loaders set it, and a text splitter's `split_documents` keeps a document's pieces in order
    with its metadata), as far back as the context can hold (core/prefill/context.py); None for
    a document's first piece or a text without a source."""
    if not context_tokens or not metadatas:
        return [None] * len(texts)
    earlier: dict[str, list[str]] = {}
    out: list[str | None] = []
    for text, metadata in zip(texts, metadatas):
        source = (metadata or {}).get("source")
        if not isinstance(source, (str, int)) or isinstance(source, bool):
            out.append(None)
            continue
        pieces = earlier.setdefault(str(source), [])
        out.append(text_before(reversed(pieces), text, context_tokens))
        if text and text.strip():
            pieces.append(text)
    return out


class KVCachingVectorStore(VectorStore):
    """Wraps `vectorstore` (default: embedded Chroma over the bundled MiniLM embeddings).

    Args:
        vectorstore: the store to wrap; None builds a Chroma collection (`DefaultChroma`).
        engine: the TurboRAGEngine whose model encodes the blobs (share it with the chat model);
            None uses the shared engine of `model`.
        registry: where ingested and retrieved texts are recorded for the chat model (None:
            the engine's own, `ChunkRegistry.for_engine(engine)`).
        namespace: the store namespace (a tenant) the blobs go into: the engine's view
            `engine.namespaced(namespace)`, and a default Chroma collection of its own; give
            the chat model the same one. None: the engine's own.
        check_fingerprint: refuse a store whose documents were encoded by another model.
        turborag_metadata: keep the `turborag_*` keys in returned documents' metadata. Off by
            default, so documents come back exactly as they were added.
        progress: callable(done, total) for encoding progress.

    Keywords for the parts not given:
        model, device, dtype, model_kwargs, tokenizer_kwargs: the shared engine when no
            `engine` is given — the model, where it runs, its blobs' dtype and what its
            `from_pretrained` is given (as `TurboRAGChatModel(model=, device=, ...)`; give both
            the same, or share one engine).
        embedding, persist_directory, collection_name, chroma_url, chroma_client: the default
            Chroma store (`DefaultChroma`), refused beside a `vectorstore`. chroma_url keeps it
            on the Chroma server at this URL (e.g. "http://127.0.0.1:8200", started with
            `chroma run --path DIR --port 8200`) instead of embedded; a bad URL or no server
            there raises ChromaURLError or ChromaUnreachable, saying what to do. chroma_client:
            or a chromadb client (`chromadb.HttpClient(...)`, ...) to keep it with.
    """

    def __init__(self, vectorstore: VectorStore | None = None, *,
                 engine: TurboRAGEngine | None = None, registry: ChunkRegistry | None = None,
                 namespace: str | None = None, check_fingerprint: bool = True,
                 turborag_metadata: bool = False,
                 progress: Callable[[int, int], None] | None = None, **defaults: Any):
        unknown = sorted(set(defaults) - _ENGINE_OPTIONS - _CHROMA_OPTIONS)
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))}: "
                            f"KVCachingVectorStore takes {', '.join(sorted(_ENGINE_OPTIONS))} "
                            f"(the shared engine) and {', '.join(sorted(_CHROMA_OPTIONS))} (the "
                            "default Chroma store) besides its own arguments")
        chroma = {k: v for k, v in defaults.items() if k in _CHROMA_OPTIONS}
        if vectorstore is not None and chroma:
            raise ValueError(f"{', '.join(sorted(chroma))}: for the default Chroma store only, "
                             "and a vectorstore was given: configure that store instead")
        if engine is None:
            loading = ModelConfig(**{k: v for k, v in defaults.items()
                                     if k in _ENGINE_OPTIONS - {"model"}})
            engine = shared_engine(defaults.get("model"), loading)
        self.engine = engine
        if namespace is not None:
            self.engine = self.engine.namespaced(namespace)
        self.vectorstore = (vectorstore if vectorstore is not None
                            else DefaultChroma(**chroma).build(namespace))
        self.registry = registry if registry is not None else ChunkRegistry.for_engine(
            self.engine)
        self.check_fingerprint = check_fingerprint
        self.turborag_metadata = turborag_metadata
        self.progress = progress
        if check_fingerprint:
            self._check_store()

    @property
    def embeddings(self) -> Embeddings | None:
        return self.vectorstore.embeddings

    # ---- fingerprints ---------------------------------------------------------------------
    def _check_store(self) -> None:
        """Fail at construction if the store holds documents encoded by another model.

        Only stores with Chroma's `get(where=...)` can be asked this without a query; for
        others the check happens on every search instead.
        """
        get = getattr(self.vectorstore, "get", None)
        if get is None:
            return
        # Chroma's $ne also matches documents without the key (added around the wrapper), so
        # scan a bounded number of pages for one that records another fingerprint.
        where = {FINGERPRINT: {"$ne": self.engine.fingerprint.id}}
        for offset in range(0, _PRECHECK_LIMIT, _PRECHECK_PAGE):
            try:
                found = get(where=where, limit=_PRECHECK_PAGE, offset=offset,
                            include=["metadatas"])
            except Exception as exc:  # not a Chroma-like get: checked on search instead
                log.debug("cannot pre-check fingerprints of %s: %s", type(self.vectorstore), exc)
                return
            metadatas = (found or {}).get("metadatas") or []
            for metadata in metadatas:
                check_metadata(self.engine, metadata or {}, "this vector store")
            if len(metadatas) < _PRECHECK_PAGE:
                return

    def _receive(self, doc: Document) -> Document:
        """Check and register one retrieved document; return it as the caller should see it."""
        metadata = doc.metadata or {}
        if self.check_fingerprint:
            check_metadata(self.engine, metadata, f"document {doc.id!r}")
        self.registry.add(doc.page_content, metadata.get(FINGERPRINT), metadata.get(MODEL))
        if self.turborag_metadata or not any(k in metadata for k in METADATA_KEYS):
            return doc
        return doc.model_copy(update={"metadata": {k: v for k, v in metadata.items()
                                                   if k not in METADATA_KEYS}})

    # ---- writes ---------------------------------------------------------------------------
    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, *,
                  ids: list[str | None] | None = None, **kwargs: Any) -> list[str]:
        texts = list(texts)
        if metadatas is not None and len(metadatas) != len(texts):
            raise ValueError(f"got {len(metadatas)} metadatas for {len(texts)} texts")
        if ids is not None and len(ids) != len(texts):
            raise ValueError(f"got {len(ids)} ids for {len(texts)} texts")
        # Blobs are reference-counted by document id, so every document needs one now.
        doc_ids = [i or str(uuid.uuid4()) for i in (ids or [None] * len(texts))]
        self._forget_replaced(doc_ids, texts)
        keys = self._encode(texts, doc_ids, _contexts(texts, metadatas,
                                                      self.engine.library.encoder.context_tokens))
        fp = self.engine.fingerprint
        stamped = []
        for i, key in enumerate(keys):
            metadata = dict(metadatas[i] or {}) if metadatas else {}
            if key:
                metadata.update({KV_KEY: key, FINGERPRINT: fp.id, MODEL: fp.describe()})
            stamped.append(metadata)
        added = self.vectorstore.add_texts(texts, metadatas=stamped, ids=doc_ids, **kwargs)
        for text in texts:
            self.registry.add(text, fp.id, fp.describe())
        return added

    def _encode(self, texts: Sequence[str], doc_ids: Sequence[str],
                contexts: Sequence[str | None]) -> list[str | None]:
        todo = [i for i, t in enumerate(texts) if t and t.strip()]
        keys: list[str | None] = [None] * len(texts)
        # a hot set encodes a chunk on its k-th retrieval instead (core/admission.py)
        if todo and self.engine.encodes_at_ingestion:
            encoded = self.engine.encode_chunks([texts[i] for i in todo],
                                                doc_ids=[doc_ids[i] for i in todo],
                                                contexts=[contexts[i] for i in todo],
                                                progress=self.progress)
            for i, key in zip(todo, encoded):
                keys[i] = key
        return keys

    def _forget_replaced(self, doc_ids: Sequence[str], texts: Sequence[str]) -> None:
        """Drop the blob references of documents whose id is re-added with other text."""
        new_text = dict(zip(doc_ids, texts))
        try:
            existing = self.vectorstore.get_by_ids(list(new_text))
        except NotImplementedError:
            # Cannot tell which ids exist: drop them all (unchanged ones are re-encoded).
            for doc_id in new_text:
                self.engine.forget_document(doc_id)
            return
        for doc in existing:
            if doc.id in new_text and doc.page_content != new_text[doc.id]:
                self.engine.forget_document(doc.id)
                self.registry.discard(doc.page_content)

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        if ids is not None and len(ids) == 0:
            return True  # nothing to delete (some stores, Chroma among them, refuse [])
        if ids:
            try:
                for doc in self.vectorstore.get_by_ids(list(ids)):
                    self.registry.discard(doc.page_content)
            except NotImplementedError:
                pass
        result = self.vectorstore.delete(ids, **kwargs)
        for doc_id in ids or ():
            self.engine.forget_document(doc_id)
        return result

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings,
                   metadatas: list[dict] | None = None, *, ids: list[str] | None = None,
                   **kwargs: Any) -> "KVCachingVectorStore":
        """Build the store (the default Chroma over `embedding`, unless `vectorstore=` is
        given), then add and encode `texts`. `kwargs`: the constructor's keywords, and the rest
        for `add_texts`."""
        own = set(inspect.signature(cls.__init__).parameters) | _ENGINE_OPTIONS | _CHROMA_OPTIONS
        made = {k: kwargs.pop(k) for k in list(kwargs) if k in own}
        if made.get("vectorstore") is None:
            made["embedding"] = embedding
        store = cls(**made)
        store.add_texts(texts, metadatas, ids=ids, **kwargs)
        return store

    # ---- reads: the wrapped store's, documents received on the way out --------------------
    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return [self._receive(d) for d in self.vectorstore.get_by_ids(ids)]

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        return [self._receive(d) for d in self.vectorstore.similarity_search(query, k, **kwargs)]

    def similarity_search_with_score(self, query: str, k: int = 4,
                                     **kwargs: Any) -> list[tuple[Document, float]]:
        return [(self._receive(d), s)
                for d, s in self.vectorstore.similarity_search_with_score(query, k, **kwargs)]

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4,
                                    **kwargs: Any) -> list[Document]:
        return [self._receive(d)
                for d in self.vectorstore.similarity_search_by_vector(embedding, k, **kwargs)]

    def max_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20,
                                      lambda_mult: float = 0.5, **kwargs: Any) -> list[Document]:
        docs = self.vectorstore.max_marginal_relevance_search(
            query, k=k, fetch_k=fetch_k, lambda_mult=lambda_mult, **kwargs)
        return [self._receive(d) for d in docs]

    def max_marginal_relevance_search_by_vector(self, embedding: list[float], k: int = 4,
                                                fetch_k: int = 20, lambda_mult: float = 0.5,
                                                **kwargs: Any) -> list[Document]:
        docs = self.vectorstore.max_marginal_relevance_search_by_vector(
            embedding, k=k, fetch_k=fetch_k, lambda_mult=lambda_mult, **kwargs)
        return [self._receive(d) for d in docs]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return self.vectorstore._select_relevance_score_fn()
