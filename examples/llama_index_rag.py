"""A LlamaIndex RAG app over a folder of text, with TurboRAG behind the stock query engine.

    python examples/llama_index_rag.py                                # repo docs + sample docs
    python examples/llama_index_rag.py --docs ~/notes --question "What did we decide?"
    python examples/llama_index_rag.py --top-k 2 --chunk-tokens 128 --runs 1   # a quick look

Ingestion splits the documents into chunks of --chunk-tokens model tokens, embeds them into an
embedded Chroma and stores each chunk's KV blob (once: a second run with the same --store skips
unchanged files). Each question is answered, streamed, with its sources; then the time to first
token of the same stock query engine is measured with TurboRAG and with a full prefill (the same
LLM in naive mode), median of --runs after a warm-up of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DOCS = [REPO / "docs", REPO / "turborag_integrations" / "data" / "sample_docs"]
DEFAULT_QUESTION = "How high is the Tall Widow lighthouse, and when was it first lit?"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=Path, action="append",
                   help="folder of .md/.txt files (repeatable; default: docs/ and sample docs)")
    p.add_argument("--question", action="append", help="question to ask (repeatable)")
    p.add_argument("--top-k", type=int, default=8, help="chunks to retrieve")
    p.add_argument("--chunk-tokens", type=int, default=512, help="chunk size in model tokens")
    p.add_argument("--runs", type=int, default=3, help="timed runs per path (after a warm-up)")
    p.add_argument("--store", type=Path, default=None,
                   help="folder for the KV store and Chroma (default: the turborag cache)")
    p.add_argument("--model", default=None, help="bundled name, local folder or HF id")
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    if args.top_k < 1 or args.runs < 1 or args.chunk_tokens < 16:
        p.error("--top-k and --runs must be ≥ 1, --chunk-tokens ≥ 16")
    args.docs = args.docs or DEFAULT_DOCS
    args.question = args.question or [DEFAULT_QUESTION]
    return args


def load_documents(folders):
    from llama_index.core import SimpleDirectoryReader

    docs = []
    for folder in folders:
        if not folder.is_dir():
            sys.exit(f"error: no such folder: {folder}")
        docs += SimpleDirectoryReader(str(folder), required_exts=[".md", ".txt"], recursive=True,
                                      filename_as_id=True).load_data()
    if not docs:
        sys.exit("error: no .md or .txt files found")
    return docs


def ingest(docs, engine, embed_model, store_dir: Path, chunk_tokens: int):
    """Split, embed and store; the wrapper stores each chunk's KV blob (with a progress bar)."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.ingestion import DocstoreStrategy, IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.storage.docstore import SimpleDocumentStore

    from turborag_integrations.llama_index import KVCachingVectorStore

    store = KVCachingVectorStore(engine, path=store_dir / "chroma",
                                 collection=f"chunks{chunk_tokens}", show_progress=True)
    splitter = SentenceSplitter(  # count in the model's tokens: a chunk is what gets cached
        chunk_size=chunk_tokens, chunk_overlap=0,
        tokenizer=lambda text: engine.tokenizer.encode(text, add_special_tokens=False))
    pipeline = IngestionPipeline(transformations=[splitter, embed_model], vector_store=store,
                                 docstore=SimpleDocumentStore(),
                                 docstore_strategy=DocstoreStrategy.UPSERTS)
    state = store_dir / f"pipeline{chunk_tokens}"
    if state.exists():
        pipeline.load(str(state))
    nodes = pipeline.run(documents=docs, show_progress=True)
    pipeline.persist(str(state))
    print(f"ingested {len(docs)} files: {len(nodes)} new or changed chunks")
    return VectorStoreIndex.from_vector_store(store, embed_model=embed_model)


def time_to_first_token(query_engine, question: str) -> float:
    """Wall time from query() to the first streamed text: retrieval, prompt, prefill."""
    t0 = time.perf_counter()
    response = query_engine.query(question)
    for piece in response.response_gen:
        if piece:
            break
    elapsed = time.perf_counter() - t0
    response.response_gen.close()
    return elapsed


def main(argv=None) -> None:
    args = parse_args(argv)
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from turborag_integrations.core.retrieval.embedding import default_embedding_path
    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.models import cache_dir
    from turborag_integrations.llama_index import TurboRAGLLM

    store_dir = (args.store or cache_dir() / "llama_index_example").expanduser()
    engine = TurboRAGEngine(args.model, store=store_dir / "kv")
    embed_model = HuggingFaceEmbedding(model_name=default_embedding_path())
    index = ingest(load_documents(args.docs), engine, embed_model, store_dir, args.chunk_tokens)

    llm = TurboRAGLLM(engine, max_new_tokens=args.max_new_tokens)
    post = llm.postprocessor()
    answerer = index.as_query_engine(llm=llm, node_postprocessors=[post],
                                     similarity_top_k=args.top_k, streaming=True)
    # Timing needs only the first token: one-token LLMs, the same stock engine, both paths.
    turbo_llm = TurboRAGLLM(engine, registry=llm.registry, max_new_tokens=1)
    timed = {name: index.as_query_engine(llm=model, node_postprocessors=[post],
                                         similarity_top_k=args.top_k, streaming=True)
             for name, model in (("turbo", turbo_llm), ("full", turbo_llm.baseline()))}
    engine.warmup()

    for question in args.question:
        print(f"\nQ: {question}\nA: ", end="", flush=True)
        response = answerer.query(question)
        for piece in response.response_gen:
            print(piece, end="", flush=True)
        print("\n\nsources:")
        for n in response.source_nodes:
            name = n.node.metadata.get("file_name") or n.node.ref_doc_id
            print(f"  {n.score:.3f}  {name}")
        s = llm.last_stats
        print(f"prompt: {s['prompt_tokens']} tokens, {s['reused_tokens']} reused from the KV "
              f"store, {s['prefilled_tokens']} prefilled ({s['cache_hits']} chunk hits, "
              f"{s['cache_misses']} misses)")

        ttft = {name: [] for name in timed}
        for name, qe in timed.items():
            time_to_first_token(qe, question)  # warm-up
        for _ in range(args.runs):  # interleaved, so both see the same machine load
            for name, qe in timed.items():
                ttft[name].append(time_to_first_token(qe, question))
        turbo, full = (statistics.median(ttft[k]) for k in ("turbo", "full"))
        print(f"TTFT through the query engine, median of {args.runs}:")
        print(f"  TurboRAG:     {turbo * 1000:8.1f} ms")
        print(f"  full prefill: {full * 1000:8.1f} ms   ({full / turbo:.1f}x slower)")


if __name__ == "__main__":
    main()
