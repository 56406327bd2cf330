"""The vector stores, the workspace and the command line over a real Chroma server.

One `chroma run` process serves the module, on a free loopback port with its files under a
temporary folder; each test keeps to its own collections. The models are the tiny random-weight
ones and the bundled MiniLM embeddings of the other suites.
"""

from __future__ import annotations

import http.server
import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.conftest import write_docs
from tests.langchain.conftest import cached_tiny_engine
from tests.langchain.helpers import PROMPT, format_docs, sample_paragraphs
from tests.llama_index.conftest import DOCS as LI_DOCS
from tests.llama_index.conftest import build_index, make_engine
from tests.test_cli import DOCS as CLI_DOCS
from tests.test_cli import last_json
from turborag_integrations.cli import app
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.core.retrieval.chroma import (ChromaUnreachable, ChromaURLError,
                                                         chroma_client, parse_chroma_url)
from turborag_integrations.workspace import Workspace

STARTUP_TIMEOUT_S = 60  # two busy cores can make the server slow to come up


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def chroma_executable() -> str | None:
    beside = Path(sys.executable).parent / "chroma"  # the venv's, when it is not activated
    return str(beside) if beside.exists() else shutil.which("chroma")


def wait_for_heartbeat(url: str, process: subprocess.Popen, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"`chroma run` exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/api/v2/heartbeat", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    pytest.fail(f"`chroma run` did not answer at {url} within {STARTUP_TIMEOUT_S} s:\n"
                f"{log.read_text()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The URL of a Chroma server running for this module."""
    exe = chroma_executable()
    if exe is None:
        pytest.skip("no `chroma` executable (it comes with the chromadb package) next to "
                    "Python or on PATH")
    folder = tmp_path_factory.mktemp("chroma-server")
    port = free_port()
    log = folder / "server.log"
    with log.open("wb") as out:
        process = subprocess.Popen([exe, "run", "--path", str(folder / "data"),
                                    "--host", "127.0.0.1", "--port", str(port)],
                                   stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_heartbeat(url, process, log)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def http_client(url: str):
    import chromadb

    host, port, ssl = parse_chroma_url(url)
    return chromadb.HttpClient(host=host, port=port, ssl=ssl)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# ---- LlamaIndex ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embed_model():
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from turborag_integrations.core.retrieval.embedding import default_embedding_path

    return HuggingFaceEmbedding(model_name=default_embedding_path())


def read_from_another_process(url: str, collection: str) -> dict:
    """The collection's documents and metadata as a separate Python process sees them."""
    host, port, _ = parse_chroma_url(url)
    code = ("import json, chromadb\n"
            f"c = chromadb.HttpClient(host={host!r}, port={port}).get_collection({collection!r})\n"
            "print(json.dumps(c.get(include=['documents', 'metadatas'])))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_llama_index_store_on_a_server_answers_with_reused_tokens(server, tmp_path,
                                                                  embed_model):
    from turborag_integrations.llama_index import (KVCachePostprocessor, KVCachingVectorStore,
                                                   TurboRAGLLM)
    from turborag_integrations.llama_index.nodes import KV_KEY_METADATA

    engine = make_engine(tmp_path)
    collection = unique("li")
    index = build_index(KVCachingVectorStore(engine, url=server, collection=collection),
                        embed_model)
    llm = TurboRAGLLM(engine, max_new_tokens=6)
    query_engine = index.as_query_engine(llm=llm, similarity_top_k=2,
                                         node_postprocessors=[KVCachePostprocessor(engine)])
    response = query_engine.query("How high is the Tall Widow lighthouse?")
    stats = llm.last_stats
    assert str(response) and stats["reused_tokens"] > 0
    assert stats["cache_hits"] == 2 and stats["cache_misses"] == 0
    assert "Tall Widow" in response.source_nodes[0].node.get_content()

    # The server holds the nodes, KV keys included, for any other client to read.
    seen = read_from_another_process(server, collection)
    assert sorted(seen["documents"]) == sorted(LI_DOCS.values())
    assert all(m[KV_KEY_METADATA] for m in seen["metadatas"])


def test_vector_store_given_wins_over_url(tmp_path):
    from llama_index.core.vector_stores import SimpleVectorStore

    from turborag_integrations.llama_index import KVCachingVectorStore

    inner = SimpleVectorStore()
    unused = f"http://127.0.0.1:{free_port()}"  # never contacted
    store = KVCachingVectorStore(cached_tiny_engine(0), inner, url=unused)
    assert store.vector_store is inner


# ---- LangChain ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    from turborag_integrations.langchain import SentenceTransformerEmbeddings

    return SentenceTransformerEmbeddings()


def test_langchain_store_on_a_server_feeds_a_chain_that_reuses_blobs(server, tmp_path, minilm):
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough

    from turborag_integrations.langchain import (ChunkRegistry, KVCachingVectorStore,
                                                 TurboRAGChatModel)

    engine = TurboRAGEngine(cached_tiny_engine(0).loaded, store=str(tmp_path / "kv"),
                            progress=False)
    registry = ChunkRegistry()
    collection = unique("lc")
    store = KVCachingVectorStore(engine=engine, embedding=minilm, chroma_url=server,
                                 collection_name=collection, registry=registry)
    docs = sample_paragraphs(6)
    ids = store.add_documents(docs)
    question = "When was Velmora founded, and by whom?"
    found = store.similarity_search(question, k=3)
    assert len(found) == 3
    assert {d.page_content for d in found} <= {d.page_content for d in docs}

    llm = TurboRAGChatModel(engine=engine, registry=registry, max_tokens=6)
    chain = ({"context": store.as_retriever(search_kwargs={"k": 3}) | RunnableLambda(format_docs),
              "question": RunnablePassthrough()} | PROMPT | llm)
    stats = chain.invoke(question).response_metadata["turborag"]
    assert stats["cache_hits"] == 3 and stats["cache_misses"] == 0
    assert stats["reused_tokens"] > 0

    # A chromadb client of one's own reaches the same collection.
    again = KVCachingVectorStore(engine=engine, embedding=minilm,
                                 chroma_client=http_client(server), collection_name=collection)
    assert sorted(d.id for d in again.get_by_ids(ids)) == sorted(ids)


def test_langchain_store_refuses_a_folder_and_a_server_together(tmp_path):
    from turborag_integrations.langchain import KVCachingVectorStore

    with pytest.raises(ValueError, match="persist_directory is for the embedded Chroma"):
        KVCachingVectorStore(engine=cached_tiny_engine(0), persist_directory=str(tmp_path),
                             chroma_url="http://127.0.0.1:8000")


# ---- Workspace and command line -----------------------------------------------------------

runner = CliRunner()


@pytest.fixture
def docs(tmp_path):
    return write_docs(tmp_path / "docs", CLI_DOCS)


def run(*args, env: dict | None = None):
    # The URL comes from the arguments unless a test sets it in `env`, whatever the shell has.
    result = runner.invoke(app, [str(a) for a in args],
                           env={"TURBORAG_CHROMA_URL": None, **(env or {})})
    return result.exit_code, result.output


def test_cli_ingests_and_asks_through_a_server(server, tmp_path, docs, model_dir):
    ws = tmp_path / "ws"
    code, out = run("ingest", docs, "--workspace", ws, "--model", model_dir, "--chunk-tokens", 64,
                    "--chroma-url", server, "--json")
    assert code == 0, out
    assert last_json(out)["ingested"] == 3
    assert not (ws / "chroma").exists()  # nothing went to an embedded Chroma

    code, out = run("ask", "Which ship has a blue hull?", "--workspace", ws, "--chroma-url", server,
                    "--json", "--max-new-tokens", 8)
    assert code == 0, out
    report = last_json(out)
    assert report["reused_fraction"] > 0.5 and report["sources"]

    # The URL may come from the environment instead.
    code, out = run("ingest", docs, "--workspace", ws, "--json",
                    env={"TURBORAG_CHROMA_URL": server})
    assert code == 0, out
    assert last_json(out)["skipped"] == 3
    code, out = run("store", "stats", "--workspace", ws, "--chroma-url", server, "--json")
    stats = last_json(out)
    assert stats["chunks_indexed"] >= 3 and stats["chroma"] == server

    # Asked without the server, the empty embedded Chroma's error says where the chunks are.
    code, out = run("ask", "Which ship has a blue hull?", "--workspace", ws)
    assert code == 2 and f"--chroma-url {server}" in out


def test_workspaces_on_one_server_keep_their_own_collections(server, tmp_path, docs, model_dir):
    first = Workspace(tmp_path / "a", model=model_dir, chunk_tokens=64, chroma_url=server)
    second = Workspace(tmp_path / "b", model=model_dir, chunk_tokens=64, chroma_url=server)
    assert first.collection_name != second.collection_name
    first.ingest([docs])
    assert first.collection.count() >= 3 and second.collection.count() == 0
    reopened = Workspace(tmp_path / "a", chroma_url=server)  # another process, say
    assert reopened.collection_name == first.collection_name
    assert reopened.collection.count() == first.collection.count()


def test_demo_on_a_server_removes_its_temporary_collection(server, tmp_path, docs, model_dir):
    client = http_client(server)
    before = {c.name for c in client.list_collections()}
    code, out = run("demo", "Which ship has a blue hull?", "--docs", docs, "--model", model_dir,
                    "--kv-store", tmp_path / "kv", "--chunk-tokens", 64, "--max-new-tokens", 4,
                    "--chroma-url", server)
    assert code == 0, out
    assert "sources: a.md" in out and "TTFT TurboRAG:" in out
    assert {c.name for c in client.list_collections()} == before


# ---- errors -------------------------------------------------------------------------------

def test_no_server_at_the_url_is_a_clear_error_everywhere(tmp_path, docs, model_dir):
    from turborag_integrations.langchain import KVCachingVectorStore as LangChainStore
    from turborag_integrations.llama_index import KVCachingVectorStore as LlamaIndexStore

    port = free_port()  # nothing listens there
    url = f"http://127.0.0.1:{port}"
    start = f"chroma run --path ./chroma --port {port}"
    with pytest.raises(ChromaUnreachable) as caught:
        chroma_client(url=url)
    assert url in str(caught.value) and start in str(caught.value)
    engine = cached_tiny_engine(0)
    with pytest.raises(ChromaUnreachable, match=start):
        LlamaIndexStore(engine, url=url)
    with pytest.raises(ChromaUnreachable, match=start):
        LangChainStore(engine=engine, chroma_url=url)
    with pytest.raises(ChromaUnreachable, match=start):
        Workspace(tmp_path / "ws", chroma_url=url)
    code, out = run("ingest", docs, "--workspace", tmp_path / "ws", "--model", model_dir,
                    "--chroma-url", url)
    assert code == 2 and url in out and start in out


class _NotChroma(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass


def test_a_server_that_is_not_chroma_is_named_as_such():
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _NotChroma)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(ChromaUnreachable, match="not a Chroma server"):
            chroma_client(url=url)
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.parametrize("url, says", [
    ("127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("ftp://127.0.0.1:8000", "http:// or https://"),
    ("http://", "http:// or https://"),
    ("http://127.0.0.1:port", "bad port"),
    ("http://127.0.0.1:8000/api/v2", "give only those"),
])
def test_bad_urls_say_what_a_good_one_looks_like(url, says):
    with pytest.raises(ChromaURLError, match=re.escape(says)):
        parse_chroma_url(url)


def test_url_ports_default_to_chromas_and_https():
    assert parse_chroma_url("http://localhost") == ("localhost", 8000, False)
    assert parse_chroma_url(" https://chroma.example/ ") == ("chroma.example", 443, True)
    assert parse_chroma_url("http://127.0.0.1:9000") == ("127.0.0.1", 9000, False)
