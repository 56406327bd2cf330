"""RAG over folders of text with LangChain: TurboRAG KV reuse next to full prefill.

The same LCEL chain runs twice, once with the chat model reusing the cached KV of the retrieved
chunks and once in "naive" mode (everything prefilled), and reports median time to first token:

    retriever | format_docs | prompt | llm | StrOutputParser()

    python examples/langchain_rag.py                         # repo docs/ + bundled sample docs
    python examples/langchain_rag.py --docs ~/notes --question "..." --runs 5

Ingestion embeds the chunks into a Chroma index for this run and stores each chunk's KV blob in
the KV store (--kv-store), where it stays: a rerun over the same documents encodes only the
chunks it has not seen. The flags are those of examples/llama_index_rag.py.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from turborag_integrations.core.retrieval.chunking import split_text
from turborag_integrations.core.engine import TurboRAGEngine
from turborag_integrations.langchain import (KVCachingVectorStore, TurboRAGChatModel,
                                             TurboRAGRunCollector)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DOCS = [REPO / "docs", REPO / "turborag_integrations" / "data" / "sample_docs"]
DEFAULT_QUESTION = "How high is the Tall Widow lighthouse in Velmora?"
SUFFIXES = (".md", ".rst", ".txt")

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You are a helpful assistant. Answer the question using only the context."),
    ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
])


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
    p.add_argument("--max-new-tokens", type=int, default=32,
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


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def load_chunks(paths: list[Path], tokenizer, chunk_tokens: int) -> list[Document]:
    docs = []
    for path in find_files(paths):
        for i, chunk in enumerate(split_text(path.read_text(errors="replace"), tokenizer,
                                             chunk_tokens)):
            # Ids from the content: the same text is added once.
            digest = hashlib.blake2b(f"{path}|{i}|{chunk}".encode(), digest_size=12)
            docs.append(Document(page_content=chunk, id=digest.hexdigest(),
                                 metadata={"source": str(path), "chunk": i}))
    return docs


def run_once(chain, question: str, *, echo: bool) -> tuple[float, TurboRAGRunCollector, str]:
    """Stream one answer; return wall time to the first text, the collected stats and text."""
    run = TurboRAGRunCollector()
    start = time.perf_counter()
    first = None
    parts = []
    for text in chain.stream(question, config={"callbacks": [run]}):
        if first is None and text:
            first = time.perf_counter() - start
        parts.append(text)
        if echo:
            print(text, end="", flush=True)
    if echo:
        print()
    return first or (time.perf_counter() - start), run, "".join(parts)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine = TurboRAGEngine(args.model, store=args.kv_store and args.kv_store.expanduser(),
                            progress=False)
    docs = load_chunks(args.docs, engine.tokenizer, args.chunk_tokens)
    with tempfile.TemporaryDirectory(prefix="turborag-langchain-") as index_dir:
        store = KVCachingVectorStore(engine=engine, persist_directory=index_dir)
        llm = TurboRAGChatModel(engine=engine, max_tokens=args.max_new_tokens)
        # before ingesting: each chunk is also encoded right after this prompt's head, so the
        # chunk the retriever puts first is stitched exactly as a full prefill computes it
        llm.add_prompt(PROMPT)
        t0 = time.perf_counter()
        store.add_documents(docs)
        print(f"ingested {len(docs)} chunks of ≤{args.chunk_tokens} tokens in "
              f"{time.perf_counter() - t0:.1f} s ({engine.loaded.name}, KV store "
              f"{engine.store.root})")

        retriever = store.as_retriever(search_kwargs={"k": args.top_k})
        context = {"context": retriever | RunnableLambda(format_docs),
                   "question": RunnablePassthrough()}
        chains = {"turbo": context | PROMPT | llm | StrOutputParser(),
                  "naive": context | PROMPT | llm.bind(mode="naive") | StrOutputParser()}
        for question in args.question:
            answer_and_time(chains, question, args.runs)
    return 0


def answer_and_time(chains: dict, question: str, runs: int) -> None:
    """Show both chains' answers to `question` (their warm-up), then time `runs` of each."""
    print(f"\nQ: {question}\nA (turbo): ", end="")
    _, run, _ = run_once(chains["turbo"], question, echo=True)  # warm-up, shown
    print("sources:")
    for doc in run.documents:
        print(f"  - {Path(doc.metadata.get('source', '?')).name} #{doc.metadata.get('chunk')}")
    print("A (naive): ", end="")
    run_once(chains["naive"], question, echo=True)  # warm-up, shown

    results: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "wall": []} for m in chains}
    last = {}
    for _ in range(runs):
        for mode, chain in chains.items():
            wall, run, _ = run_once(chain, question, echo=False)
            results[mode]["ttft"].append(run.stats.get("ttft_s", float("nan")))
            results[mode]["wall"].append(wall)
            last[mode] = run.stats

    print(f"\nmedians over {runs} runs (after one warm-up each):")
    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in results.items()}
    for mode in chains:
        s = last[mode]
        print(f"  {mode:5s}  model TTFT {med[mode]['ttft'] * 1000:8.1f} ms   chain first text "
              f"{med[mode]['wall'] * 1000:8.1f} ms   prompt {s.get('prompt_tokens')} tok, "
              f"reused {s.get('reused_tokens')}, prefilled {s.get('prefilled_tokens')}, "
              f"hits {s.get('cache_hits')}/{s.get('cache_hits', 0) + s.get('cache_misses', 0)}")
    ratio = med["naive"]["ttft"] / med["turbo"]["ttft"] if med["turbo"]["ttft"] else float("nan")
    print(f"  TTFT speed-up (naive / turbo): {ratio:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
