"""A LlamaIndex RAG app over folders of text, with TurboRAG behind the stock query engine.

    python examples/llama_index_rag.py                                # repo docs + sample docs
    python examples/llama_index_rag.py --docs ~/notes --question "What did we decide?"
    python examples/llama_index_rag.py --top-k 2 --chunk-tokens 128 --runs 1   # a quick look

Ingestion splits the documents into chunks of --chunk-tokens model tokens, embeds them into a
Chroma index for this run and stores each chunk's KV blob in the KV store (--kv-store), where it
stays: a rerun over the same documents encodes only the chunks it has not seen. Each question is
answered, streamed, with its sources; then the time to first token of the same stock query
engine is measured with TurboRAG and with a full prefill (the same LLM in naive mode), median of
--runs after a warm-up of each. examples/langchain_rag.py takes the same flags.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DOCS = [REPO / "docs", REPO / "turborag_integrations" / "data" / "sample_docs"]
DEFAULT_QUESTION = "How high is the Tall Widow lighthouse, and when was it first lit?"
SUFFIXES = (".md", ".rst", ".txt")


def arg_parser() -> argparse.ArgumentParser:
    """The flags of both framework examples, spelled and meant alike."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", nargs="+", type=Path, default=DEFAULT_DOCS, metavar="PATH",
                   help="folders or files of text (.md .rst .txt; default: docs/ and the "
                   "bundled sample documents)")
    p.add_argument("--question", action="append",
                   help="a question to ask (repeatable; default: one the sample documents answer)")
    p.add_argument("--top-k", type=int, default=8, help="chunks to retrieve (default: %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="chunk size in model tokens (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="timed runs of TurboRAG and of a full "
                   "prefill each, after a warm-up of each (default: %(default)s)")
    p.add_argument("--model", default=None,
                   help="bundled name, local folder or HF id (default: the bundled SmolLM2)")
    p.add_argument("--max-new-tokens", type=int, default=96,
                   help="longest answer shown, in tokens (default: %(default)s)")
    p.add_argument("--kv-store", type=Path, default=None, metavar="DIR",
                   help="KV store folder: the chunks' KV blobs alone, kept between runs "
                   "(default ~/.cache/turborag/kv or $TURBORAG_STORE)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = arg_parser()
    args = p.parse_args(argv)
    if min(args.top_k, args.runs, args.max_new_tokens) < 1 or args.chunk_tokens < 16:
        p.error("--top-k, --runs and --max-new-tokens must be at least 1, --chunk-tokens at "
                "least 16")
    missing = [str(d) for d in args.docs if not d.exists()]
    if missing:
        p.error(f"--docs: no such file or folder: {', '.join(missing)}")
    args.question = args.question or [DEFAULT_QUESTION]
    return args


def find_files(paths: list[Path]) -> list[Path]:
    """The text files given, and those under the folders given (hidden ones left out)."""
    found = []
    for path in paths:
        if path.is_file():
            found += [path] if path.suffix.lower() in SUFFIXES else []
            continue
        found += [f for f in sorted(path.rglob("*")) if f.is_file()
                  and f.suffix.lower() in SUFFIXES
                  and not any(part.startswith(".") for part in f.relative_to(path).parts)]
    if not found:
        sys.exit(f"error: no {' '.join(SUFFIXES)} files in {', '.join(map(str, paths))}: give "
                 "--docs folders or files of text")
    return found


def load_documents(paths: list[Path]):
    from llama_index.core import SimpleDirectoryReader

    return SimpleDirectoryReader(input_files=[str(f) for f in find_files(paths)],
                                 filename_as_id=True).load_data()


def ingest(docs, engine, embed_model, index_dir: Path, chunk_tokens: int):
    """Split, embed and index; the wrapper stores each chunk's KV blob (with a progress bar),
    skipping the blobs already in the KV store."""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from turborag_integrations.llama_index import KVCachingVectorStore

    store = KVCachingVectorStore(engine, path=index_dir, collection=f"chunks{chunk_tokens}",
                                 show_progress=True)
    splitter = SentenceSplitter(  # count in the model's tokens: a chunk is what gets cached
        chunk_size=chunk_tokens, chunk_overlap=0,
        tokenizer=lambda text: engine.tokenizer.encode(text, add_special_tokens=False))
    pipeline = IngestionPipeline(transformations=[splitter, embed_model], vector_store=store)
    t0 = time.perf_counter()
    nodes = pipeline.run(documents=docs, show_progress=True)
    print(f"ingested {len(docs)} documents: {len(nodes)} chunks of ≤{chunk_tokens} tokens in "
          f"{time.perf_counter() - t0:.1f} s ({engine.loaded.name}, KV store {engine.store.root})")
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

    docs = load_documents(args.docs)
    engine = TurboRAGEngine(args.model, store=args.kv_store and args.kv_store.expanduser())
    embed_model = HuggingFaceEmbedding(model_name=default_embedding_path())
    with tempfile.TemporaryDirectory(prefix="turborag-llama-index-") as index_dir:
        index = ingest(docs, engine, embed_model, Path(index_dir), args.chunk_tokens)
        answer_and_time(args, engine, index)


def answer_and_time(args: argparse.Namespace, engine, index) -> None:
    """Answer each question, streamed, with its sources; then time both paths."""
    from turborag_integrations.llama_index import TurboRAGLLM

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
