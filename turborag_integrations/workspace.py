"""A ready-made RAG app over a folder: embedded Chroma for retrieval, the KV store for TurboRAG.

The command line and the example web app are thin shells around this class:

    ws = Workspace()                         # ~/.cache/turborag/workspace (or TURBORAG_WORKSPACE)
    ws.ingest(["docs/"])                     # chunk, embed, encode KV blobs; reruns skip what's done
    answer = ws.ask("What is ...?")          # stream(), sources, stats

    with Workspace.temporary() as ws:        # for one run (`turborag demo`): only the blobs stay
        ...

    ws = Workspace(chroma_url="http://127.0.0.1:8200")   # chunks on a `chroma run` server
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .core import environment
from .core.prefill.anchor import CONTEXT_MARKER, VALUE_MARKER
from .core.prefill.context import DEFAULT_CONTEXT_TOKENS, document_contexts
from .core.retrieval.chroma import chroma_client
from .core.retrieval.chunking import split_text
from .core.retrieval.embedding import DEFAULT_EMBEDDING, load_embedder
from .core.engine import GenerationStream, TurboRAGEngine
from .core.errors import TurboRAGError
from .core.settings import GenerationConfig
from .core.config import EngineConfig
from .core.models import DEFAULT_MODEL, ModelConfig
from .core.store import KVStore, default_store_path
from .documents import UndecodableDocument, find_documents, read_document
from .core.prompt_template import render_chat

SYSTEM_PROMPT = "Answer the question using only the context. Be brief."
COLLECTION = "turborag_chunks"

log = logging.getLogger(__name__)


class WorkspaceError(TurboRAGError):
    """A workspace cannot do what was asked (no documents, other model, bad path...)."""


def default_workspace() -> Path:
    return environment.workspace_dir()


@dataclass(frozen=True)
class IngestProgress:
    """Where an ingestion stands: files done of all, and bytes of those files encoded (a file's
    bytes advance with its chunks, so a long file moves the count as it goes)."""

    files: int
    total_bytes: int
    path: str = ""
    files_done: int = 0
    done_bytes: int = 0


@dataclass
class Source:
    path: str
    text: str
    score: float


@dataclass
class Answer:
    """A streamed answer: iterate for text; then `.text`, `.stats`, `.sources`."""

    stream: GenerationStream
    sources: list[Source]
    prompt: str
    chunks: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[str]:
        return iter(self.stream)

    @property
    def text(self) -> str:
        return self.stream.result.text if self.stream.result else ""

    @property
    def stats(self):
        return self.stream.result.stats if self.stream.result else None


class Workspace:
    """Documents → Chroma + KV store, under one folder, for one model.

    Chroma is embedded in the folder, or is the server at `chroma_url`: see `collection_name`.
    """

    def __init__(self, root: str | Path | None = None, *, model: str | None = None,
                 chunk_tokens: int = 512, engine: TurboRAGEngine | None = None,
                 encoder: str | None = None,
                 chroma_url: str | None = None, context_tokens: int | None = None,
                 loading: ModelConfig | None = None):
        """encoder: the learned chunk encoding (core/prefill/encoding.py): "default" (the file
        shipped for a bundled model; the default for a new workspace), "none", or a file; None
        keeps what the workspace was built with.

        context_tokens: each chunk is encoded after up to this many tokens of the file's text
        before it (docs/concepts.md#context-encoding); None keeps what the workspace was built
        with (TurboRAGEngine's default for a new one).

        chroma_url: a Chroma server (e.g. http://127.0.0.1:8200, started with `chroma run
        --path DIR --port 8200`) to keep the chunks in, so that several processes can share
        them; None keeps them in an embedded Chroma in the folder. The server is contacted
        here: a bad URL or no server raises a TurboRAGError that says what to do.

        loading: how the model loads (core/models.py `ModelConfig`: device, dtype, transformers
        keyword arguments); None: on the CPU in float32. Blobs are made in its dtype, so a
        workspace asked in another dtype encodes its chunks again."""
        self.root = Path(root).expanduser() if root else default_workspace()
        self.root.mkdir(parents=True, exist_ok=True)
        self.chroma_url = chroma_url or None
        # Connect now, not on first use: a missing server then fails before a model loads.
        self._chroma = chroma_client(url=self.chroma_url) if self.chroma_url else None
        manifest = self._read_manifest()
        if manifest and model and manifest["model"] != model:
            raise WorkspaceError(
                f"workspace {self.root} was built with model {manifest['model']!r}, not "
                f"{model!r}; use another --workspace folder, or omit --model")
        self.model_name = model or (manifest or {}).get("model") or DEFAULT_MODEL
        self.chunk_tokens = (manifest or {}).get("chunk_tokens", chunk_tokens)
        self.embedding_name = (manifest or {}).get("embedding") or DEFAULT_EMBEDDING
        self.encoder = encoder or (manifest or {}).get("encoder") or "default"
        # a manifest from before context encoding has no entry: its blobs were made without
        self.context_tokens = context_tokens if context_tokens is not None else (
            manifest.get("context_tokens", 0) if manifest else DEFAULT_CONTEXT_TOKENS)
        self.kv_dir = self.root / "kv"
        self._engine = engine
        self.loading = loading or ModelConfig()
        self._head_added = False
        self._embedder = None
        self._collection = None
        self._rapid = None

    @classmethod
    @contextmanager
    def temporary(cls, *, kv_dir: str | Path | None = None, **options) -> Iterator[Workspace]:
        """A workspace for one run, in a temporary folder deleted on exit.

        Its KV blobs go to `kv_dir` (default: the engines' shared store, ~/.cache/turborag/kv
        or $TURBORAG_STORE) and outlive it, so that a rerun over the same documents reuses
        them rather than encoding them again. `options` are the constructor's (model,
        chunk_tokens, encoder, ...)."""
        # Chroma may still hold its files open at exit (Windows refuses to delete those).
        with tempfile.TemporaryDirectory(prefix="turborag-workspace-",
                                         ignore_cleanup_errors=True) as folder:
            workspace = cls(folder, **options)
            workspace.kv_dir = Path(kv_dir).expanduser() if kv_dir else default_store_path()
            try:
                yield workspace
            finally:
                workspace._drop_server_collection()

    # ---- lazily built parts -----------------------------------------------------------------
    @property
    def engine(self) -> TurboRAGEngine:
        if self._engine is None:
            self._engine = TurboRAGEngine(self.model_name, store=KVStore(self.kv_dir),
                                          config=EngineConfig(model=self.loading),
                                          encoder=self.encoder,
                                          context_tokens=self.context_tokens)
        if not self._head_added:
            # the first source of a question asked without history follows this head: its
            # lead blob makes it exact (core/library.py)
            self._head_added = True
            self._engine.add_prompt(render_chat(self._engine.tokenizer,
                self.messages(VALUE_MARKER, CONTEXT_MARKER)))
        return self._engine

    @property
    def embedder(self):
        if self._embedder is None:
            self._embedder = load_embedder(self.embedding_name)
        return self._embedder

    @property
    def collection_name(self) -> str:
        """The Chroma collection of this workspace's chunks.

        An embedded Chroma belongs to the folder, so the plain name is enough. A server may be
        shared by many workspaces: there the name ends with a digest of the folder's absolute
        path, so that each folder (whose manifest and KV blobs the chunks go with) keeps its
        own collection, and every process opening the same folder finds the same one."""
        if not self.chroma_url:
            return COLLECTION
        digest = hashlib.sha256(str(self.root.resolve()).encode()).hexdigest()[:12]
        return f"{COLLECTION}_{digest}"

    @property
    def collection(self):
        if self._collection is None:
            if self._chroma is None:
                self._chroma = chroma_client(path=self.root / "chroma")
            self._collection = self._chroma.get_or_create_collection(
                self.collection_name, metadata={"hnsw:space": "cosine"})
        return self._collection

    def _drop_server_collection(self) -> None:
        """Delete the collection a temporary workspace made on a server (an embedded one goes
        with its folder)."""
        if self.chroma_url is None or self._collection is None:
            return
        try:
            self._chroma.delete_collection(self.collection_name)
        except Exception as exc:  # the run's outcome matters more than this cleanup
            log.warning("could not delete the temporary collection %s on the Chroma server at "
                        "%s: %s", self.collection_name, self.chroma_url, exc)

    @staticmethod
    def built_at(root: str | Path | None = None) -> bool:
        """Whether documents were ingested into the workspace at `root` (default: the default
        workspace): it has a manifest. Creates nothing."""
        root = Path(root).expanduser() if root else default_workspace()
        return (root / "manifest.json").exists()

    def _read_manifest(self) -> dict | None:
        path = self.root / "manifest.json"
        return json.loads(path.read_text()) if path.exists() else None

    def _write_manifest(self) -> None:
        data = {"model": self.model_name, "fingerprint": self.engine.fingerprint.id,
                "chunk_tokens": self.chunk_tokens, "embedding": self.embedding_name,
                "encoder": self.encoder, "chroma_url": self.chroma_url,
                "context_tokens": self.context_tokens}
        tmp = self.root / "manifest.json.tmp"
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, self.root / "manifest.json")

    # ---- ingestion --------------------------------------------------------------------------
    def ingest(self, paths: Sequence[str | Path],
               progress: Callable[[IngestProgress], None] | None = None) -> dict:
        """Ingest files and folders. A file whose content is already in is skipped; a changed
        file replaces its old chunks and blobs; a file that is not text is skipped with a
        warning. Blobs are stored as they are made, so an interrupted ingestion resumes where
        it stopped. progress(IngestProgress) after each file and each batch of chunks.
        Returns counts."""
        files = find_documents(paths)
        manifest = self._read_manifest()
        if manifest and manifest["fingerprint"] != self.engine.fingerprint.id:
            raise WorkspaceError(f"workspace {self.root} holds blobs of another model setup "
                                 f"({manifest['model']}); use another --workspace folder")
        self._write_manifest()
        counts = {"files": len(files), "skipped": 0, "ingested": 0, "chunks": 0,
                  "unreadable": 0}
        # Progress is counted in bytes of the files, known before anything is read, so that
        # it moves (and an ETA exists) within a long file as its chunks are encoded.
        sizes = [path.stat().st_size for path in files]
        state = IngestProgress(files=len(files), total_bytes=sum(sizes))

        def report(path: Path, n: int, done_bytes: int) -> None:
            if progress:
                progress(replace(state, path=str(path), files_done=n, done_bytes=done_bytes))

        before = 0
        for n, (path, size) in enumerate(zip(files, sizes), 1):
            report(path, n - 1, before)
            doc_id = str(path.resolve())
            try:
                text = read_document(path)
            except UndecodableDocument as exc:
                log.warning("%s", exc)
                warnings.warn(str(exc), stacklevel=2)
                counts["unreadable"] += 1
                before += size
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            existing = self.collection.get(where={"doc_id": doc_id}, include=["metadatas"])
            if existing["ids"] and all(m.get("sha") == digest for m in existing["metadatas"]):
                counts["skipped"] += 1
                before += size
                continue
            if existing["ids"]:  # the file changed: drop its old chunks and blobs
                self.collection.delete(ids=existing["ids"])
                self.engine.store.delete_doc(doc_id)
            chunks = split_text(text, self.engine.tokenizer, self.chunk_tokens)
            if chunks:
                # Blobs first, then Chroma: a file counts as done only once both are written,
                # so an interrupted ingestion redoes it (its blobs are found and skipped).
                if self.engine.encodes_at_ingestion:  # else the hot set's (core/admission.py)
                    self.engine.encode_chunks(
                        chunks, doc_ids=[doc_id] * len(chunks),
                        contexts=document_contexts(chunks,
                                                   self.engine.library.encoder.context_tokens),
                        progress=lambda done, total, path=path, n=n, base=before, size=size:
                            report(path, n - 1, base + size * done // max(total, 1)))
                vectors = self.embedder.encode(chunks, normalize_embeddings=True).tolist()
                self.collection.add(
                    ids=[f"{digest}-{i}" for i in range(len(chunks))], documents=chunks,
                    embeddings=vectors,
                    metadatas=[{"doc_id": doc_id, "source": str(path), "sha": digest, "index": i}
                               for i in range(len(chunks))])
            counts["ingested"] += 1
            counts["chunks"] += len(chunks)
            before += size
        report(files[-1], len(files), before)
        return counts

    # ---- questions --------------------------------------------------------------------------
    def retrieve(self, question: str, k: int = 4) -> list[Source]:
        if self.collection.count() == 0:
            raise WorkspaceError(self._ingested_elsewhere() or
                                 f"the workspace {self.root} has no documents yet: run "
                                 "`turborag ingest DIR` first")
        vector = self.embedder.encode([question], normalize_embeddings=True).tolist()
        found = self.collection.query(query_embeddings=vector, n_results=min(k, self.collection.count()))
        return [Source(path=m["source"], text=doc, score=1.0 - dist)
                for doc, m, dist in zip(found["documents"][0], found["metadatas"][0],
                                        found["distances"][0])]

    def _ingested_elsewhere(self) -> str | None:
        """For an empty collection: a message if the last ingestion used another Chroma."""
        manifest = self._read_manifest()
        if manifest is None or manifest.get("chroma_url") == self.chroma_url:
            return None
        used = manifest.get("chroma_url")  # absent in manifests older than servers: embedded
        here = (f"on the Chroma server at {self.chroma_url}" if self.chroma_url
                else "in its embedded Chroma")
        if used is None:
            return (f"the workspace {self.root} has no documents {here}: they were ingested "
                    "into its embedded Chroma; leave out --chroma-url, or ingest again with it")
        return (f"the workspace {self.root} has no documents {here}: they were ingested into "
                f"the Chroma server at {used}; pass --chroma-url {used}, or ingest again")

    def prompt(self, question: str, sources: Sequence[Source],
               history: Sequence[dict] = ()) -> str:
        context = "\n\n".join(s.text for s in sources)
        return render_chat(self.engine.tokenizer, self.messages(question, context, history))

    @staticmethod
    def messages(question: str, context: str, history: Sequence[dict] = ()) -> list[dict]:
        """The chat a question is asked in: the system prompt, any history, then the user's
        turn with the retrieved context before the question."""
        return [{"role": "system", "content": SYSTEM_PROMPT}, *history,
                {"role": "user", "content": f"Context:\n\n{context}\n\nQuestion: {question}"}]

    def ask(self, question: str, *, k: int = 4, mode: str = "turbo",
            config: GenerationConfig | None = None, history: Sequence[dict] = ()) -> Answer:
        if not question.strip():
            raise WorkspaceError("the question is empty")
        sources = self.retrieve(question, k)
        prompt = self.prompt(question, sources, history)
        chunks = [s.text for s in sources]
        stream = self.engine.stream(prompt, chunks=chunks, config=config, mode=mode,
                                    encode_missing=True)
        return Answer(stream=stream, sources=sources, prompt=prompt, chunks=chunks)

    def ask_rapid(self, question: str, *, k: int = 4,
                  config: GenerationConfig | None = None) -> Answer:
        """RAPID: the model reads the whole documents of the retrieved chunks (as many as fit
        its window) and verifies drafts from a drafter that reads only the chunks."""
        from .core.rapid import RapidEngine

        sources = self.retrieve(question, k)
        config = config or GenerationConfig()
        budget = self.engine.context_window - config.max_new_tokens - 256
        docs, used = [], 0
        for path in dict.fromkeys(s.path for s in sources):  # best-ranked documents first
            text = read_document(Path(path))
            n = len(self.engine.tokenizer(text, add_special_tokens=False)["input_ids"])
            if used + n <= budget:
                docs.append(text)
                used += n
        if not docs:
            raise WorkspaceError("the retrieved documents do not fit the model's window for "
                                 "RAPID; use --mode turbo")
        context = "\n\n".join(docs)
        if self._rapid is None:
            self._rapid = RapidEngine(self.engine, embedder=self.embedder)
        chunks = [s.text for s in sources if s.text in context]
        stream = self._rapid.stream(context, question, chunks=chunks, config=config)
        return Answer(stream=stream, sources=sources, prompt=context, chunks=chunks)

    def full_prefill_ttft(self, answer: Answer) -> float:
        """TTFT of the same prompt with everything prefilled (the comparison baseline)."""
        return self.full_prefill(answer, GenerationConfig(max_new_tokens=1)).stats.ttft_s

    def full_prefill(self, answer: Answer, config: GenerationConfig | None = None):
        """The same prompt answered with everything prefilled, as the model answers without
        the package: the answer to set beside TurboRAG's (a GenerationResult)."""
        return self.engine.generate(answer.prompt, config=config, mode="naive")

    def documents(self) -> list[str]:
        """The files ingested into this workspace, as they were named to `ingest`."""
        if not self.built_at(self.root):
            return []
        found = self.collection.get(include=["metadatas"])["metadatas"]
        return sorted({m["source"] for m in found if m and "source" in m})

    def stitched_ttft(self, answer: Answer) -> float:
        """TTFT of the same prompt from its chunks' blobs with no query-time recovery: what the
        default recovery costs on top, and what vLLM's connector serves."""
        one = GenerationConfig(max_new_tokens=1)
        return self.engine.generate(answer.prompt, chunks=answer.chunks, config=one,
                                    recovery="none").stats.ttft_s
