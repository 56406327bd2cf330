"""Stock clients against vLLM with the TurboRAG connector: LlamaIndex's `OpenAILike` behind a
stock query engine and LangChain's `ChatOpenAI` in an LCEL chain, unchanged but for the
`cache_salt` that opts a request in. The chunks are ingested with the HF engine (this process);
vLLM (its own venv) reuses their blobs, as its prefix-cache counters show."""

from __future__ import annotations

import re
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from .test_vllm_connector import PYTHON, ROOT, require_vllm

MODEL = "smollm2-135m-instruct"
SALT = {"cache_salt": "turborag"}
DOCS = [
    "The Tall Widow lighthouse stands 41 metres high on the cliffs north of Harrow Bay. It was "
    "first lit in 1872 and its lamp can be seen from 22 nautical miles away on a clear night.",
    "The Orbital Kiln Company was founded in 1994 by the ceramicist Ada Brennan. It builds "
    "electric kilns in a former rope works at Wexcombe and employs about 140 people.",
    "The Haldor Glacier expedition of 1931 was led by Signe Falk. Its radio operator, Tomas "
    "Reyes, kept the only diary that survived the winter on the ice.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def external_hits(url: str) -> float:
    """vLLM's counter of prompt tokens supplied by the KV connector."""
    return counter(url, "vllm:external_prefix_cache_hits")


def reused(url: str) -> float:
    """Prompt tokens not computed: from the connector, or from vLLM's own prefix cache (where a
    request repeating a stitched prefix finds the blocks the connector filled before)."""
    return external_hits(url) + counter(url, "vllm:prefix_cache_hits")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    require_vllm()
    pytest.importorskip("llama_index.llms.openai_like")
    pytest.importorskip("langchain_openai")
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.bundled import prepare_bundled
    from turborag_integrations.vllm.launch import cpu_environment, kv_transfer_config, server_argv

    store = str(tmp_path_factory.mktemp("vllm-store"))
    engine = TurboRAGEngine(MODEL, store=store, progress=False)  # the bundled chunk encoder
    engine.encode_chunks(DOCS)
    engine.close()
    port = free_port()
    argv = server_argv(PYTHON, prepare_bundled(MODEL, progress=False),
                       kv_transfer_config(store, encoder=MODEL), host="127.0.0.1", port=port,
                       served_model_name=MODEL, extra=["--max-model-len", "2048"])
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**cpu_environment(), "HF_HUB_OFFLINE": "1",
                                     "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    try:
        while True:
            assert proc.poll() is None, Path(log).read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not start within 900 s"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_llama_index_query_engine_with_openai_like_reuses_the_chunks(served):
    from llama_index.core import Document, MockEmbedding, VectorStoreIndex
    from llama_index.llms.openai_like import OpenAILike

    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCS],
                                            embed_model=MockEmbedding(embed_dim=8))
    assert sorted(n.get_content() for n in index.docstore.docs.values()) == sorted(DOCS)
    llm = OpenAILike(model=MODEL, api_base=f"{served}/v1", api_key="unused", is_chat_model=True,
                     temperature=0, max_tokens=12, context_window=2048,
                     additional_kwargs={"extra_body": SALT})
    first = external_hits(served)
    for streaming in (False, True):
        before = reused(served)
        engine = index.as_query_engine(llm=llm, similarity_top_k=3, streaming=streaming)
        response = engine.query("How high is the Tall Widow lighthouse?")
        answer = "".join(response.response_gen) if streaming else str(response)
        assert answer.strip()
        # the system prompt and template head, three chunks and the separators between them
        assert reused(served) - before > 150
    assert external_hits(served) - first > 150  # the first query's came from the connector


def test_langchain_chat_openai_in_an_lcel_chain_reuses_the_chunks(served):
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=t) for t in DOCS])
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only the context."),
        ("human", "Context:\n{context}\n\nQuestion: {question}"),
    ])
    llm = ChatOpenAI(model=MODEL, base_url=f"{served}/v1", api_key="unused", temperature=0,
                     max_tokens=12, extra_body=SALT)
    chain = ({"context": store.as_retriever(search_kwargs={"k": 3})
              | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()}
             | prompt | llm | StrOutputParser())
    before, first = reused(served), external_hits(served)
    invoked = chain.invoke("Who led the Haldor Glacier expedition?")
    streamed = "".join(chain.stream("Who led the Haldor Glacier expedition?"))
    assert invoked.strip() and streamed == invoked
    assert reused(served) - before > 2 * 100
    assert external_hits(served) - first > 100


def test_a_request_without_the_salt_is_not_served_stitched_blocks(served):
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Context:\n" + "\n\n".join(DOCS)
                          + "\n\nQuestion: Who founded the Orbital Kiln Company?"}]}
    before = external_hits(served)
    plain = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=300).json()
    assert external_hits(served) == before and not plain.get("kv_transfer_params")
    salted = httpx.post(f"{served}/v1/chat/completions", json={**body, **SALT},
                        timeout=300).json()
    assert salted["kv_transfer_params"]["turborag"]["claimed_tokens"] > 100


def sample(url: str, name: str) -> float:
    """The sum of one Prometheus sample over its labels (0 when vLLM shows none yet)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def test_the_workers_figures_reach_vllms_metrics(served):
    """Every token the scheduler claimed is one the workers wrote from a blob, and vLLM's
    /metrics shows both (the workers' figures arrive with the step outputs, so a little later)."""
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, **SALT,
            "messages": [{"role": "user", "content": "Context:\n" + "\n\n".join(DOCS[1:])
                          + "\n\nQuestion: Who kept the diary?"}]}
    reply = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=300).json()
    assert reply["kv_transfer_params"]["turborag"]["claimed_tokens"] > 100
    deadline = time.monotonic() + 20
    while True:
        loaded = sample(served, "vllm:turborag_loaded_tokens_total")
        if loaded == external_hits(served) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert loaded == external_hits(served) > 100
    assert sample(served, "vllm:turborag_loaded_spans_total") >= 3
    assert sample(served, "vllm:turborag_load_seconds_count") >= 1
    assert sample(served, "vllm:turborag_load_errors_total") == 0
