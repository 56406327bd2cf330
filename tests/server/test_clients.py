"""Stock OpenAI clients, unchanged, against a live server: LlamaIndex's `OpenAILike` behind a
stock query engine, and LangChain's `ChatOpenAI` in an LCEL chain. Their answers are the engine's
own for the same prompt, and the chunks ingested beforehand are reused without the clients
sending anything but OpenAI's fields."""

import time

import pytest

from turborag_integrations.core.registry import ChunkRegistry
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.server.app import create_app
from turborag_integrations.server.schemas import ChatCompletionRequest

from .conftest import DOCS, Recorder, final_stats, running
from turborag_integrations.core.prompt_template import render_chat

QUESTION = "How high is the Tall Widow lighthouse?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(engine):
    recorder = Recorder(create_app(engine))
    with running(recorder) as url:
        yield url, recorder


def engine_answer(engine, request_body: dict, chunks) -> str:
    """What the engine itself answers to the prompt a client sent (greedy)."""
    prompt = render_chat(engine.tokenizer, ChatCompletionRequest.model_validate(request_body).chat())
    return engine.generate(prompt, chunks=chunks,
                           config=GenerationConfig(max_new_tokens=MAX_TOKENS)).text


def completions(recorder, since: int, count: int):
    """The `count` chat completions recorded after the first `since` exchanges: (request body,
    response body) each."""
    deadline = time.monotonic() + 10
    while True:  # a stream is recorded once the app returns, just after the client has read it
        found = [(body, response) for path, body, response in recorder.exchanges[since:]
                 if path == "/v1/chat/completions"]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def test_llama_index_query_engine_with_openai_like(server, engine):
    pytest.importorskip("llama_index.llms.openai_like")
    import httpx
    from llama_index.core import Document, MockEmbedding, VectorStoreIndex
    from llama_index.llms.openai_like import OpenAILike

    url, recorder = server
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCS],
                                            embed_model=MockEmbedding(embed_dim=8))
    texts = [node.get_content() for node in index.docstore.docs.values()]
    r = httpx.post(f"{url}/v1/turborag/chunks", json={"texts": texts}, timeout=120)
    assert r.status_code == 200 and r.json()["indexed"] == len(DOCS)

    llm = OpenAILike(model=engine.loaded.name, api_base=f"{url}/v1", api_key="unused",
                     is_chat_model=True, temperature=0, max_tokens=MAX_TOKENS,
                     context_window=engine.context_window)
    since = len(recorder.exchanges)
    for streaming in (False, True):
        query_engine = index.as_query_engine(llm=llm, similarity_top_k=2, streaming=streaming)
        response = query_engine.query(QUESTION)
        answer = "".join(response.response_gen) if streaming else str(response)
        (body, raw), = completions(recorder, since, 1)
        since = len(recorder.exchanges)
        assert body["stream"] is streaming
        assert answer == engine_answer(engine, body, texts)
        stats = final_stats(raw)
        assert stats["cache_hits"] == 2 and stats["reused_tokens"] > 0


def test_langchain_chat_openai_in_an_lcel_chain(server, engine):
    pytest.importorskip("langchain_openai")
    from langchain_core.documents import Document
    from langchain_core.embeddings import DeterministicFakeEmbedding
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI

    url, recorder = server
    # Ingested in this process, through the engine's registry (as the LangChain adapters do).
    texts = DOCS
    engine.encode_chunks(texts)
    ChunkRegistry.for_engine(engine).add(texts, engine.fingerprint.id)

    store = InMemoryVectorStore(DeterministicFakeEmbedding(size=16))
    store.add_documents([Document(page_content=t) for t in texts])
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question using only the context."),
        ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
    ])
    llm = ChatOpenAI(model=engine.loaded.name, base_url=f"{url}/v1", api_key="unused",
                     temperature=0, max_tokens=MAX_TOKENS)
    chain = ({"context": store.as_retriever(search_kwargs={"k": 2})
              | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()}
             | prompt | llm | StrOutputParser())

    since = len(recorder.exchanges)
    answers = [chain.invoke(QUESTION), "".join(chain.stream(QUESTION))]
    (invoked, raw_invoked), (streamed, raw_streamed) = completions(recorder, since, 2)
    assert streamed["stream"] and not invoked.get("stream")
    assert answers[0] == answers[1] == engine_answer(engine, invoked, texts)
    for raw in (raw_invoked, raw_streamed):
        stats = final_stats(raw)
        assert stats["cache_hits"] == 2 and stats["reused_tokens"] > 0
