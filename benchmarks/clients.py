"""Stock OpenAI clients against `turborag serve`: TTFT and reuse, turbo server vs naive server.

    python benchmarks/clients.py              # starts each server itself, one after the other
    python benchmarks/clients.py --json

Two unchanged client pipelines, each pointed at the server over loopback:
- LlamaIndex: a stock `VectorStoreIndex` query engine (top 8, streaming) with `OpenAILike`;
- LangChain: an LCEL chain `{context: retriever | join, question} | prompt | ChatOpenAI | parser`.
Both retrieve from the same nodes (the bundled sample documents and synthetic records, ≈256
tokens each, embedded with the bundled MiniLM), whose texts were posted once to
`/v1/turborag/chunks`. The same questions run against `turborag serve` (turbo) and then against
`turborag serve --mode naive` (full prefill). TTFT is measured at the client: from the call to
the first streamed token (it includes the query's retrieval, the same in both modes). The share
of prompt tokens reused comes from the server's /metrics counters. Greedy, 16 new tokens.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import chunk_texts, start_worker  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "turborag_integrations" / "data" / "sample_docs"
QUESTIONS = [
    "How high is the Tall Widow lighthouse?",
    "Who founded the Orbital Kiln Company?",
    "Who led the Haldor Glacier expedition?",
    "How many people does Orbital Kiln employ?",
    "What was the greatest ice thickness the expedition recorded?",
]
MAX_TOKENS = 16
TOP_K = 8


def nodes() -> list[str]:
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter

    docs = [Document(text=p.read_text()) for p in sorted(DOCS.glob("*.md"))]
    docs += [Document(text=t) for t in chunk_texts(24)]
    splitter = SentenceSplitter(chunk_size=256, chunk_overlap=0)
    return [n.get_content() for n in splitter.get_nodes_from_documents(docs)]


def counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^turborag_(prompt_tokens|reused_tokens)_total (\S+)$", text, re.M)}


def llama_index_pipeline(url: str, model: str, texts: list[str], embed):
    from llama_index.core import Settings, VectorStoreIndex
    from llama_index.core.schema import TextNode
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=model, api_base=f"{url}/v1", api_key="unused", is_chat_model=True,
                     temperature=0, max_tokens=MAX_TOKENS)
    Settings.embed_model = embed
    index = VectorStoreIndex([TextNode(text=t) for t in texts])
    engine = index.as_query_engine(llm=llm, streaming=True, similarity_top_k=TOP_K)

    def ask(question: str) -> tuple[float, str]:
        t0 = time.perf_counter()
        response = engine.query(question)
        first, text = None, ""
        for delta in response.response_gen:
            first = first or time.perf_counter()
            text += delta
        return (first or time.perf_counter()) - t0, text
    return ask


def langchain_pipeline(url: str, model: str, texts: list[str]):
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_openai import ChatOpenAI

    from turborag_integrations.langchain.embeddings import SentenceTransformerEmbeddings

    store = InMemoryVectorStore.from_texts(texts, SentenceTransformerEmbeddings())
    retriever = store.as_retriever(search_kwargs={"k": TOP_K})
    prompt = ChatPromptTemplate.from_messages([
        ("system", "Answer the question from the context."),
        ("human", "Context:\n\n{context}\n\nQuestion: {question}")])
    llm = ChatOpenAI(model=model, base_url=f"{url}/v1", api_key="unused", temperature=0,
                     max_tokens=MAX_TOKENS)
    chain = ({"context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
              "question": RunnablePassthrough()} | prompt | llm | StrOutputParser())

    def ask(question: str) -> tuple[float, str]:
        t0 = time.perf_counter()
        first, text = None, ""
        for delta in chain.stream(question):
            if delta:
                first = first or time.perf_counter()
                text += delta
        return (first or time.perf_counter()) - t0, text
    return ask


def measure(mode: str, texts: list[str], embed, runs: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="turborag-clients-") as store:
        proc, url = start_worker(None, store, "--mode", mode)
        try:
            model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
            httpx.post(f"{url}/v1/turborag/chunks", json={"texts": texts},
                       timeout=1800).raise_for_status()
            out = {}
            for name, ask in (("llama_index", llama_index_pipeline(url, model, texts, embed)),
                              ("langchain", langchain_pipeline(url, model, texts))):
                ask(QUESTIONS[0])  # warm-up: first-call costs of the client and the server
                before = counters(url)
                ttfts, answers = [], []
                for _ in range(runs):
                    for q in QUESTIONS:
                        ttft, text = ask(q)
                        ttfts.append(ttft)
                        answers.append(text)
                after = counters(url)
                prompt = after["prompt_tokens"] - before["prompt_tokens"]
                reused = after["reused_tokens"] - before["reused_tokens"]
                out[name] = {"ttft_median_s": statistics.median(ttfts),
                             "prompt_tokens_per_request": prompt / len(ttfts),
                             "reused_share": reused / prompt if prompt else 0.0,
                             "answers": answers[:len(QUESTIONS)]}
            return out
        finally:
            proc.terminate()
            proc.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="passes over the questions per mode")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from llama_index.core.embeddings import BaseEmbedding

    from turborag_integrations.core.retrieval.embedding import load_embedder

    model = load_embedder(None, "cpu")

    class MiniLM(BaseEmbedding):  # the bundled sentence-transformers model, for LlamaIndex
        def _get_text_embedding(self, text):
            return model.encode([text], normalize_embeddings=True)[0].tolist()

        def _get_query_embedding(self, query):
            return self._get_text_embedding(query)

        async def _aget_query_embedding(self, query):
            return self._get_text_embedding(query)

    texts = nodes()
    report = {"nodes": len(texts), "top_k": TOP_K, "max_tokens": MAX_TOKENS,
              "turbo": measure("turbo", texts, MiniLM(), args.runs),
              "naive": measure("naive", texts, MiniLM(), args.runs)}
    for name in ("llama_index", "langchain"):
        t, n = report["turbo"][name], report["naive"][name]
        report[name] = {"ttft_speedup": n["ttft_median_s"] / t["ttft_median_s"],
                        "reused_share": t["reused_share"],
                        "answers_equal": sum(a == b for a, b in zip(t["answers"], n["answers"]))}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{len(texts)} nodes, top {TOP_K}, {MAX_TOKENS} new tokens, median of "
          f"{args.runs} x {len(QUESTIONS)} questions")
    print(f"{'client':>12} {'prompt tok':>10} {'reused':>7} {'TTFT turbo':>11} "
          f"{'TTFT naive':>11} {'speed-up':>9} {'same answer':>12}")
    for name in ("llama_index", "langchain"):
        t, n, r = report["turbo"][name], report["naive"][name], report[name]
        print(f"{name:>12} {t['prompt_tokens_per_request']:>10.0f} {r['reused_share']:>7.0%} "
              f"{t['ttft_median_s']:>10.3f}s {n['ttft_median_s']:>10.3f}s "
              f"{r['ttft_speedup']:>8.1f}x {r['answers_equal']:>9}/{len(QUESTIONS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
