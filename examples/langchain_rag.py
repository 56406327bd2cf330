"""RAG over a folder of text with LangChain: TurboRAG KV reuse next to full prefill.

The same LCEL chain runs twice, once with the chat model reusing the cached KV of the retrieved
chunks and once in "naive" mode (everything prefilled), and reports median time to first token:

    retriever | format_docs | prompt | llm | StrOutputParser()

    python examples/langchain_rag.py                         # repo docs/ + bundled sample docs
    python examples/langchain_rag.py --docs ~/notes --question "..." --runs 5

Ingestion (embedding + KV encoding) happens once; with --store it persists between runs (without,
it goes to a temporary folder removed at exit). The flags are those of examples/llama_index_rag.py.
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
SUFFIXES = {".md", ".txt", ".rst"}

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You are a helpful assistant. Answer the question using only the context."),
    ("human", "Context:\n\n{context}\n\nQuestion: {question}"),
])


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(d.page_content for d in docs)


def load_chunks(folders: list[Path], tokenizer, chunk_tokens: int) -> list[Document]:
    docs = []
    for folder in folders:
        paths = [folder] if folder.is_file() else sorted(folder.rglob("*"))
        for path in paths:
            if path.suffix.lower() not in SUFFIXES or not path.is_file():
                continue
            for i, chunk in enumerate(split_text(path.read_text(errors="replace"), tokenizer,
                                                 chunk_tokens)):
                # Ids from the content: re-running over the same folder adds nothing twice.
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", nargs="+", type=Path, default=DEFAULT_DOCS,
                    help="folders or files of text (.md, .txt, .rst)")
    ap.add_argument("--question", default="How high is the Tall Widow lighthouse in Velmora?")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per mode, after a warm-up")
    ap.add_argument("--max-new-tokens", "--max-tokens", dest="max_tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M)")
    ap.add_argument("--store", "--workdir", dest="store", type=Path, default=None,
                    help="folder for the KV store and Chroma (default: a temporary folder, "
                    "removed at exit)")
    args = ap.parse_args(argv)
    if args.store is not None:
        return answer_and_time(args, args.store)
    with tempfile.TemporaryDirectory(prefix="turborag-langchain-") as tmp:
        return answer_and_time(args, Path(tmp))


def answer_and_time(args: argparse.Namespace, workdir: Path) -> int:
    """Ingest into `workdir`, then answer and time both chains."""
    engine = TurboRAGEngine(args.model, store=str(workdir / "kv"), progress=False)
    store = KVCachingVectorStore(engine=engine, persist_directory=str(workdir / "chroma"))
    docs = load_chunks(args.docs, engine.tokenizer, args.chunk_tokens)
    if not docs:
        print(f"no {sorted(SUFFIXES)} files under {[str(d) for d in args.docs]}", file=sys.stderr)
        return 1
    llm = TurboRAGChatModel(engine=engine, max_tokens=args.max_tokens)
    # before ingesting: each chunk is also encoded right after this prompt's head, so the
    # chunk the retriever puts first is stitched exactly as a full prefill computes it
    llm.add_prompt(PROMPT)
    t0 = time.perf_counter()
    store.add_documents(docs)
    print(f"ingested {len(docs)} chunks of ≤{args.chunk_tokens} tokens in "
          f"{time.perf_counter() - t0:.1f} s ({engine.loaded.name}, store {workdir})")

    retriever = store.as_retriever(search_kwargs={"k": args.top_k})
    context = {"context": retriever | RunnableLambda(format_docs),
               "question": RunnablePassthrough()}
    chains = {"turbo": context | PROMPT | llm | StrOutputParser(),
              "naive": context | PROMPT | llm.bind(mode="naive") | StrOutputParser()}

    print(f"\nQ: {args.question}\nA (turbo): ", end="")
    _, run, _ = run_once(chains["turbo"], args.question, echo=True)  # warm-up, shown
    print("sources:")
    for doc in run.documents:
        print(f"  - {Path(doc.metadata.get('source', '?')).name} #{doc.metadata.get('chunk')}")
    print("A (naive): ", end="")
    run_once(chains["naive"], args.question, echo=True)  # warm-up, shown

    results: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "wall": []} for m in chains}
    last = {}
    for i in range(args.runs):
        for mode, chain in chains.items():
            wall, run, _ = run_once(chain, args.question, echo=False)
            results[mode]["ttft"].append(run.stats.get("ttft_s", float("nan")))
            results[mode]["wall"].append(wall)
            last[mode] = run.stats

    print(f"\nmedians over {args.runs} runs (after one warm-up each):")
    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in results.items()}
    for mode in chains:
        s = last[mode]
        print(f"  {mode:5s}  model TTFT {med[mode]['ttft'] * 1000:8.1f} ms   chain first text "
              f"{med[mode]['wall'] * 1000:8.1f} ms   prompt {s.get('prompt_tokens')} tok, "
              f"reused {s.get('reused_tokens')}, prefilled {s.get('prefilled_tokens')}, "
              f"hits {s.get('cache_hits')}/{s.get('cache_hits', 0) + s.get('cache_misses', 0)}")
    ratio = med["naive"]["ttft"] / med["turbo"]["ttft"] if med["turbo"]["ttft"] else float("nan")
    print(f"  TTFT speed-up (naive / turbo): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
