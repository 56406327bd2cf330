"""Answer accuracy of stock LlamaIndex and LangChain RAG pipelines, TurboRAG vs full prefill.

    python benchmarks/pipelines.py                                   # the held-out set
    python benchmarks/pipelines.py turborag_integrations/data/devset/test.jsonl --limit 3
    python benchmarks/pipelines.py --pipelines langchain --engine-arg context_tokens=0 --json
    python benchmarks/pipelines.py --k 10                            # top-10 retrieval
    python benchmarks/pipelines.py --recovery boundary:32            # TurboRAG with recovery
    python benchmarks/pipelines.py --recovery none --recovery select:0.15   # several, one run
    python benchmarks/pipelines.py --per-item                        # the old per-item corpora
    python benchmarks/pipelines.py --out answers.jsonl               # every reply, one per line
    python benchmarks/pipelines.py --store kv/                       # keep (and reuse) the blobs

The JSONL set has lines {"id", "question", "answers": [...], "chunks": [...], "gold": [indices
into chunks], "unanswerable": bool}. Corpus (an item's chunks are one document's sections in
order: one node per chunk, no further splitting, a document's nodes linked in order as a node
parser links them — LangChain: metadata "source" — in an embedded Chroma with the bundled MiniLM embeddings, behind our KVCachingVectorStore, which
stores each chunk's KV blob at ingestion):

- shared (the default): the union of the chunks of all items of the set (all of them, whatever
  --limit says), deduplicated, ingested once per pipeline into one collection before any item is
  asked (not timed); each question retrieves the top --k (default 6) chunks from it. This is how
  the pipelines are used: a corpus wider than the question, so the prompt holds distractors from
  other items and the gold chunk may be missed ("gold_retrieved"). On the held-out set (5.7
  chunks per item) k = 6 gives prompts about as long as per-item ones, ≈700 tokens with
  SmolLM2's tokenizer; a larger k gives longer ones;
- --per-item: each item gets its own collection holding only its chunks, and every one of them is
  retrieved (k = number of chunks). The model then sees only its own item's chunks, gold always
  among them: an easier task than real use, kept so older result files stay reproducible.

Each question is answered by:

- llama_index: `index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()],
  similarity_top_k=k)`, default (compact) response mode and default templates;
- langchain: `{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt |
  chat_model | StrOutputParser()` with the common question-first RAG prompt ("You are an
  assistant for question-answering tasks. ... Question: ... Context: ..."); stitching needs
  `--engine-arg question_last=true` there, which moves the chunks before the question;
- langchain_system: the same chain with the context-first chat prompt of LangChain's tutorials
  (system: "Answer the question based only on the following context: {context}", human: the
  question).

Each pipeline answers twice with one and the same query engine / chain: the LLM in mode "turbo"
(stitched chunk KV caches) and in mode "naive" (full prefill). Decoding is greedy and stops at a
blank line or after --max-new-tokens. An answerable item is correct when a normalised answer occurs
in the reply; an item marked "unanswerable" is correct when the reply declines (is_refusal). Each
row also records which chunks the pipeline retrieved (LlamaIndex: the response's source nodes;
LangChain: the documents reaching format_docs): how many, and whether one of the item's gold
chunks was among them ("gold_retrieved", for items with "gold"). Per pipeline and mode the summary
gives the share of items whose gold was retrieved, how often the TurboRAG reply equals the
full-prefill one, and how often the two are both right or both wrong. Time to first token and
reused tokens come from the LLM's own stats (model side: chunk lookup, blob loading, stitching and
prefill; not retrieval). The first item is answered once untimed in each mode and pipeline before
it is measured, so one-off costs (the template head's blob) are not counted. Ingesting the shared
corpus encodes every chunk of the set once (408 for the held-out set; minutes on a CPU), even for
--limit 1; the second pipeline reuses the first one's blobs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")  # Chroma: no telemetry attempts offline

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "turborag_integrations" / "data" / "heldout" / "heldout.jsonl"
PIPELINES = ("llama_index", "langchain", "langchain_system")
MODES = ("naive", "turbo")  # full prefill first: the baseline of each item
MODE_NAMES = {"naive": "full prefill", "turbo": "TurboRAG"}


def variants(recoveries: list[str | None]) -> list[tuple[str, str | None]]:
    """(mode, recovery) answered per item: the full prefill first, then TurboRAG once per
    recovery asked for (the LLM's own default where none is)."""
    return [("naive", None)] + [("turbo", r) for r in (recoveries or [None])]


def variant_name(mode: str, recovery: str | None) -> str:
    return mode if recovery is None else f"{mode}+{recovery}"
STOP = ("\n\n",)  # a blank line ends the answer
DEFAULT_K = 6  # chunks retrieved per question from the shared corpus
LANGCHAIN_RAG_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, just say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\nQuestion: {question} \n"
    "Context: {context} \nAnswer:")
LANGCHAIN_SYSTEM_PROMPT = "Answer the question based only on the following context:\n\n{context}"


# ---- data -------------------------------------------------------------------------------------
def load_jsonl(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """Items (as dicts) and (line number, reason) for each malformed line: the harness's reader,
    so both judge the same lines the same way."""
    from turborag_integrations.evaluation.harness import load_items

    report = load_items(path)
    items = [{"id": it.id, "question": it.question, "answers": it.answers, "chunks": it.chunks,
              "gold": [g for g in it.gold if isinstance(g, int) and 0 <= g < len(it.chunks)],
              "unanswerable": it.unanswerable, "line": it.line} for it in report.items
             if it.chunks]
    return items, report.errors


def shared_corpus(items: list[dict]) -> list[str]:
    """Every distinct chunk of `items`, once, in order of first appearance."""
    return list(dict.fromkeys(c for it in items for c in it["chunks"]))


def corpus_sources(items: list[dict]) -> list[str]:
    """The document of each chunk of `shared_corpus(items)`: the id of the first item that has
    it. An item's chunks are one document's sections in order, so they are ingested as that
    document's consecutive pieces, as a splitter makes them."""
    first = {}
    for it in items:
        for c in it["chunks"]:
            first.setdefault(c, it["id"])
    return [first[c] for c in shared_corpus(items)]


def chunk_starts(chunks: list[str], sources: list[str]) -> list[int]:
    """Where each chunk starts in its document, as node parsers (`start_char_idx`) and text
    splitters with `add_start_index=True` ("start_index") record it: a document's chunks are
    consecutive, joined by a blank line."""
    out, start = [], 0
    for j, (chunk, source) in enumerate(zip(chunks, sources)):
        start = start if j and sources[j - 1] == source else 0
        out.append(start)
        start += len(chunk) + 2
    return out


def gold_retrieved(item: dict, retrieved: list[str]) -> bool | None:
    """Whether one of the item's gold chunks is among the retrieved texts; None without gold."""
    if not item.get("gold"):
        return None
    texts = set(retrieved)
    return any(item["chunks"][g] in texts for g in item["gold"])


def placed(retrieved: list[str], places: dict[str, tuple[str, int]]) -> list:
    """Where each retrieved text comes from, in prompt order: [document, index of the chunk in
    it] (None for a text not in the corpus)."""
    return [list(places[t]) if t in places else None for t in retrieved]


def parse_value(text: str):
    """An --engine-arg value: bool, None, int, float, else the string itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


# ---- pipelines --------------------------------------------------------------------------------
class LlamaIndexPipeline:
    """The stock query engine over one collection's nodes; the LLM's mode picks the path."""

    name = "llama_index"

    def __init__(self, engine, workdir: Path, max_new_tokens: int, order: str = "score",
                 lead: bool = True):
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding

        from turborag_integrations.core.retrieval.embedding import default_embedding_path
        from turborag_integrations.llama_index import TurboRAGLLM

        self.engine = engine
        self.path = workdir / "chroma_llama_index"
        self.embed_model = HuggingFaceEmbedding(model_name=default_embedding_path())
        self.llm = TurboRAGLLM(engine, max_new_tokens=max_new_tokens, temperature=0.0,
                               stop=list(STOP), stock_head=lead)
        self.default_recovery = self.llm.recovery
        self.postprocessor = self.llm.postprocessor()
        self.order = order
        self.query_engine = None

    def prepare(self, chunks: list[str], collection: str, k: int,
                progress: bool = False, sources: list[str] | None = None) -> None:
        """Ingest `chunks` into a new collection; build the query engine retrieving top `k`.
        `sources`: each chunk's document; a document's chunks are consecutive, in order, and
        linked as a node parser links them (SOURCE, PREVIOUS, NEXT)."""
        from llama_index.core import StorageContext, VectorStoreIndex
        from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

        from turborag_integrations.llama_index import KVCachingVectorStore

        self.store = KVCachingVectorStore(self.engine, path=self.path, collection=collection,
                                          show_progress=progress)
        nodes = [TextNode(text=c, id_=f"{collection}-{j}") for j, c in enumerate(chunks)]
        starts = chunk_starts(chunks, sources) if sources else []
        for j, node in enumerate(nodes if sources else []):
            node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id=sources[j])
            node.start_char_idx, node.end_char_idx = starts[j], starts[j] + len(node.text)
            if j and sources[j - 1] == sources[j]:
                node.relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(
                    node_id=nodes[j - 1].node_id)
                nodes[j - 1].relationships[NodeRelationship.NEXT] = RelatedNodeInfo(
                    node_id=node.node_id)
        index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(
            vector_store=self.store), embed_model=self.embed_model, show_progress=progress)
        postprocessors = [self.postprocessor]
        if self.order == "document":
            from turborag_integrations.llama_index import DocumentOrderPostprocessor

            postprocessors.insert(0, DocumentOrderPostprocessor())
        self.query_engine = index.as_query_engine(
            llm=self.llm, node_postprocessors=postprocessors, similarity_top_k=k)

    def answer(self, question: str, mode: str, recovery: str | None = None
               ) -> tuple[str, dict, list[str]]:
        """(reply, the LLM's stats, texts of the retrieved chunks)."""
        self.llm.mode = mode  # the same LLM object, so the same query engine serves both modes
        self.llm.recovery = self.default_recovery if recovery is None else recovery
        response = self.query_engine.query(question)
        retrieved = [n.node.get_content() for n in response.source_nodes]
        return (response.response or ""), dict(self.llm.last_stats or {}), retrieved


class LangChainPipeline:
    """The stock LCEL RAG chain over one collection's documents; the chat model's mode picks the
    path."""

    name = "langchain"

    def __init__(self, engine, workdir: Path, max_new_tokens: int, order: str = "score",
                 lead: bool = True):
        from langchain_core.prompts import ChatPromptTemplate

        from turborag_integrations.langchain import (SentenceTransformerEmbeddings,
                                                     TurboRAGChatModel)

        self.engine = engine
        self.path = workdir / "chroma_langchain"
        self.embeddings = SentenceTransformerEmbeddings()
        self.prompt = ChatPromptTemplate.from_template(LANGCHAIN_RAG_PROMPT)
        self.chat_model = TurboRAGChatModel(engine=engine, max_tokens=max_new_tokens,
                                            temperature=0.0, stop=list(STOP))
        self.order = order
        self.lead = lead
        self.chains = {}
        self.retrieved: list[str] = []

    def format_docs(self, docs) -> str:
        """The usual format_docs; it also notes the retrieved texts for the row."""
        self.retrieved = [d.page_content for d in docs]
        return "\n\n".join(d.page_content for d in docs)

    def prepare(self, chunks: list[str], collection: str, k: int,
                progress: bool = False, sources: list[str] | None = None) -> None:
        """Ingest `chunks` into a new collection; build the chains retrieving top `k`.
        `sources`: each chunk's document (metadata "source", as loaders set it)."""
        from langchain_core.output_parsers import StrOutputParser
        from langchain_core.runnables import RunnablePassthrough

        from turborag_integrations.langchain import KVCachingVectorStore

        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(chunks), desc="encoding chunk KV", unit="chunk")
        try:
            if self.lead:  # before ingesting, so that the lead blobs are encoded with the rest
                try:
                    self.chat_model.add_prompt(self.prompt)
                except ValueError as exc:  # a question-first prompt without question_last
                    print(f"{self.name}: no lead blobs: {exc}", file=sys.stderr)
            self.store = KVCachingVectorStore(
                engine=self.engine, embedding=self.embeddings, persist_directory=str(self.path),
                collection_name=collection,
                progress=(lambda done, total: bar.update(done - bar.n)) if bar else None)
            self.store.add_texts(chunks, ids=[f"{collection}-{j}" for j in range(len(chunks))],
                                 metadatas=[{"source": s, "start_index": i} for s, i in zip(
                                     sources, chunk_starts(chunks, sources))] if sources else None)
        finally:
            if bar is not None:
                bar.close()
        retriever = self.store.as_retriever(search_kwargs={"k": k})
        if self.order == "document":
            from turborag_integrations.langchain import in_document_order

            retriever = retriever | in_document_order
        context = {"context": retriever | self.format_docs, "question": RunnablePassthrough()}
        self.context = context
        self.chains = {}  # built from the new retriever on first use

    def chain(self, mode: str, recovery: str | None):
        """The chain for one mode and recovery: they differ only in what is bound to the same
        chat model."""
        from langchain_core.output_parsers import StrOutputParser

        key = (mode, recovery)
        if key not in self.chains:
            bound = dict(mode=mode, **({} if recovery is None else {"recovery": recovery}))
            self.chains[key] = (self.context | self.prompt | self.chat_model.bind(**bound)
                                | StrOutputParser())
        return self.chains[key]

    def answer(self, question: str, mode: str, recovery: str | None = None
               ) -> tuple[str, dict, list[str]]:
        """(reply, the chat model's stats, texts of the retrieved chunks)."""
        from turborag_integrations.langchain import TurboRAGRunCollector

        run = TurboRAGRunCollector()
        self.retrieved = []
        reply = self.chain(mode, recovery).invoke(question, config={"callbacks": [run]})
        return reply, dict(run.stats), list(self.retrieved)


class LangChainSystemPipeline(LangChainPipeline):
    """The LCEL chain with the context-first chat prompt of LangChain's RAG tutorials: the
    retrieved context in the system message, the question as the human message."""

    name = "langchain_system"

    def __init__(self, engine, workdir: Path, max_new_tokens: int, order: str = "score",
                 lead: bool = True):
        from langchain_core.prompts import ChatPromptTemplate

        super().__init__(engine, workdir, max_new_tokens, order, lead)
        self.path = workdir / "chroma_langchain_system"
        self.prompt = ChatPromptTemplate.from_messages(
            [("system", LANGCHAIN_SYSTEM_PROMPT), ("human", "{question}")])


# ---- scoring ----------------------------------------------------------------------------------
def judge(reply: str, item: dict) -> tuple[bool, bool]:
    """(correct, refusal) of one reply."""
    from turborag_integrations.evaluation.metrics import is_refusal, score

    refusal = is_refusal(reply)
    if item["unanswerable"]:
        return refusal, refusal
    return bool(score(reply, item["answers"])["contains"]), refusal


def summarise(rows: list[dict], pipelines: list[str],
              asked: list[tuple[str, str | None]] = (("naive", None), ("turbo", None))
              ) -> list[dict]:
    """One summary per pipeline and variant (mode, recovery); each TurboRAG variant is compared
    with the full prefill of the same items."""
    from turborag_integrations.evaluation.metrics import normalize

    out = []
    for pipeline in pipelines:
        ours = [r for r in rows if r["pipeline"] == pipeline]
        naive_ttft = None
        naive = {r["id"]: r for r in ours if r["mode"] == "naive" and "error" not in r}
        for mode, recovery in asked:
            every = [r for r in ours if r["mode"] == mode and r.get("recovery") == recovery]
            rs = [r for r in every if "error" not in r]
            ans = [r for r in rs if not r["unanswerable"]]
            una = [r for r in rs if r["unanswerable"]]
            med = statistics.median([r["ttft_s"] for r in rs]) if rs else None
            if mode == "naive":
                naive_ttft = med
            gold = [r["gold_retrieved"] for r in rs if r.get("gold_retrieved") is not None]
            both = [r for r in rs if r["id"] in naive]
            same = sum(normalize(r["reply"]) == normalize(naive[r["id"]]["reply"]) for r in both)
            agree = sum(r["correct"] == naive[r["id"]]["correct"] for r in both)
            recomputed = [r.get("recomputed_tokens") or 0 for r in rs]
            out.append({
                "pipeline": pipeline, "mode": mode, "recovery": recovery, "n": len(rs),
                "answerable_n": len(ans),
                "answerable_correct": sum(r["correct"] for r in ans),
                "answerable_pct": 100 * sum(r["correct"] for r in ans) / len(ans) if ans else None,
                "answerable_refused": sum(r["refusal"] for r in ans),
                "answerable_refusal_pct": (100 * sum(r["refusal"] for r in ans) / len(ans)
                                           if ans else None),
                "unanswerable_n": len(una),
                "unanswerable_refused": sum(r["correct"] for r in una),
                "total_correct_pct": 100 * sum(r["correct"] for r in rs) / len(rs) if rs else None,
                "median_ttft_s": med,
                # full-prefill TTFT / this variant's TTFT: > 1 means faster than full prefill
                "speedup": naive_ttft / med if naive_ttft and med else None,
                "median_prompt_tokens": (statistics.median([r["prompt_tokens"] for r in rs])
                                         if rs else None),
                "median_reused_tokens": (statistics.median([r["reused_tokens"] for r in rs])
                                         if rs else None),
                "median_recomputed_tokens": statistics.median(recomputed) if rs else None,
                "median_retrieved_chunks": (statistics.median([r["retrieved_chunks"] for r in rs])
                                            if rs else None),
                "gold_n": len(gold),
                "gold_retrieved": sum(gold),
                "gold_retrieved_pct": 100 * sum(gold) / len(gold) if gold else None,
                "errors": len(every) - len(rs),
                # how often this variant's reply equals (normalised) the full prefill's, and
                # how often both are right or both wrong; None for the full prefill itself
                "same_reply_as_full_pct": (100 * same / len(both) if both and mode != "naive"
                                           else None),
                "correct_agreement_pct": (100 * agree / len(both) if both and mode != "naive"
                                          else None),
            })
    return out


def print_table(results: list[dict], settings: dict) -> None:
    print(f"{settings['items']} items from {settings['data']} ({settings['answerable']} "
          f"answerable, {settings['unanswerable']} unanswerable); model {settings['model']}; "
          f"engine args {settings['engine_args'] or '{}'}; recovery {settings['recovery']}; "
          f"lead blobs {settings['lead_blobs']}; greedy, ≤{settings['max_new_tokens']} new tokens, stop at a blank line")
    if settings["corpus"] == "shared":
        print(f"corpus: shared, {settings['corpus_chunks']} distinct chunks of the whole set in "
              f"one collection; top-{settings['k']} retrieval")
    else:
        print(f"corpus: per item ({settings['corpus_chunks']} chunks in {settings['items']} "
              "collections); every chunk of the item retrieved")
    head = (f"{'pipeline':<16} {'mode':<26} {'answerable correct':>19} {'refused':>8} "
            f"{'unanswerable refused':>21} {'total correct':>14} {'gold retrieved':>15} "
            f"{'median TTFT s':>14} {'speed-up':>9} {'reused/prompt tok':>18} "
            f"{'same reply':>11}")
    print(head)
    print("-" * len(head))

    def pct(x):
        return "—" if x is None else f"{x:.1f}%"

    for r in results:
        ans = f"{r['answerable_correct']}/{r['answerable_n']} ({pct(r['answerable_pct'])})"
        ref = f"{r['answerable_refused']}/{r['answerable_n']}"
        una = f"{r['unanswerable_refused']}/{r['unanswerable_n']}"
        sp = "—" if r["mode"] == "naive" or r["speedup"] is None else f"{r['speedup']:.1f}x"
        med = "—" if r["median_ttft_s"] is None else f"{r['median_ttft_s']:.3f}"
        tok = ("—" if r["median_prompt_tokens"] is None
               else f"{r['median_reused_tokens']:.0f}/{r['median_prompt_tokens']:.0f}")
        gold = f"{r['gold_retrieved']}/{r['gold_n']} ({pct(r['gold_retrieved_pct'])})"
        name = MODE_NAMES[r["mode"]] + (f" {r['recovery']}" if r.get("recovery") else "")
        same = pct(r["same_reply_as_full_pct"])
        print(f"{r['pipeline']:<16} {name:<26} {ans:>19} {ref:>8} {una:>21} "
              f"{pct(r['total_correct_pct']):>14} {gold:>15} {med:>14} {sp:>9} {tok:>18} "
              f"{same:>11}")
    print("refused: answerable items the reply declined; gold retrieved: items with gold chunks "
          "that got one of them; speed-up: full-prefill median TTFT / this mode's; "
          "reused/prompt tok: medians; same reply: the reply equals the full prefill's")
    for r in results:
        if r["mode"] == "turbo" and r["same_reply_as_full_pct"] is not None:
            name = "TurboRAG" + (f" {r['recovery']}" if r.get("recovery") else "")
            print(f"{r['pipeline']}: {name} reply equals the full-prefill reply on "
                  f"{r['same_reply_as_full_pct']:.1f}% of items; both right or both wrong on "
                  f"{r['correct_agreement_pct']:.1f}%")
        if r["errors"]:
            print(f"{r['pipeline']} {MODE_NAMES[r['mode']]}: {r['errors']} items not answered "
                  "(see --out)")


# ---- main -------------------------------------------------------------------------------------
def main(argv=None) -> int:
    from turborag_integrations.core.models import DEFAULT_MODEL

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("data", nargs="?", type=Path, default=DEFAULT_DATA,
                    help="JSONL QA set (default: the held-out set)")
    ap.add_argument("--limit", type=int, default=None, help="first N items only")
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="bundled model name, local folder or Hugging Face id")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="keyword argument for TurboRAGEngine(...) (repeatable; values parsed as "
                         "int, float, true/false, none, else text)")
    ap.add_argument("--pipelines", default=",".join(PIPELINES),
                    help=f"comma-separated, from {', '.join(PIPELINES)} (default: all)")
    ap.add_argument("--k", type=int, default=None,
                    help=f"chunks retrieved per question from the shared corpus (default "
                         f"{DEFAULT_K})")
    ap.add_argument("--per-item", action="store_true",
                    help="the old setup: one collection per item holding only its chunks, all "
                         "of them retrieved (reproduces older result files)")
    ap.add_argument("--recovery", action="append", default=[], metavar="SPEC",
                    help="the TurboRAG mode's query-time recovery, e.g. select:0.15 (the LLMs' "
                         "`recovery` field; docs/accuracy.md); repeat it to answer each item "
                         "once per recovery, beside one full prefill (default: the LLMs' own)"),
    ap.add_argument("--order", choices=("score", "document"), default="score",
                    help="the order of the retrieved chunks in both modes' prompts: the "
                         "retriever's (score, stock) or each document's chunks together in "
                         "document order (DocumentOrderPostprocessor / in_document_order)")
    ap.add_argument("--lead-blobs", choices=("on", "off"), default="on",
                    help="encode chunks also after each pipeline's prompt head, so that the "
                         "first retrieved chunk is stitched exactly (TurboRAGLLM's stock_head, "
                         "TurboRAGChatModel.add_prompt); off: as before they existed")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, help="write every reply as JSONL to this file, each as "
                    "it comes (a stopped run keeps what it made)")
    ap.add_argument("--store", type=Path, default=None, metavar="DIR",
                    help="keep the KV store in DIR instead of a temporary folder: a later run "
                         "with the same model and encoding reads the stored blobs instead of "
                         "encoding the corpus again (blobs of another encoding are never used)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    pipelines = [p.strip() for p in args.pipelines.split(",") if p.strip()]
    unknown = [p for p in pipelines if p not in PIPELINES]
    if unknown or not pipelines:
        ap.error(f"--pipelines: unknown {unknown}; choose from {', '.join(PIPELINES)}")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be ≥ 1")
    if args.max_new_tokens < 1:
        ap.error("--max-new-tokens must be ≥ 1")
    if args.k is not None and args.k < 1:
        ap.error(f"--k must be ≥ 1 (chunks retrieved per question), got {args.k}")
    if args.per_item and args.k is not None:
        ap.error("--k is for the shared corpus; --per-item retrieves every chunk of the item")
    k = None if args.per_item else (args.k if args.k is not None else DEFAULT_K)
    engine_args = {}
    for spec in args.engine_arg:
        key, sep, value = spec.partition("=")
        if not sep or not key.strip():
            ap.error(f"--engine-arg expects KEY=VALUE, got {spec!r}")
        engine_args[key.strip()] = parse_value(value)
    if args.store is not None and "store" in engine_args:
        ap.error("give the store once: --store DIR or --engine-arg store=DIR, not both")
    from turborag_integrations.core.prefill.recovery import parse_recovery

    for spec in args.recovery:
        try:
            parse_recovery(spec)
        except ValueError as exc:
            ap.error(f"--recovery: {exc}")
    asked = variants(list(dict.fromkeys(args.recovery)))
    if not args.data.is_file():
        ap.error(f"no such file: {args.data} (give a JSONL set, e.g. "
                 "turborag_integrations/data/devset/test.jsonl)")

    items, load_errors = load_jsonl(args.data)
    for n, reason in load_errors:
        print(f"{args.data}:{n}: skipped: {reason}", file=sys.stderr)
    corpus = shared_corpus(items)  # all items of the set, whatever --limit asks
    sources = corpus_sources(items)
    places, seen = {}, collections.Counter()  # chunk text -> (its document, its index there)
    for document, text in zip(sources, corpus):
        places[text] = (document, seen[document])
        seen[document] += 1
    items = items[:args.limit] if args.limit else items
    if not items:
        print(f"error: no usable items in {args.data}", file=sys.stderr)
        return 1

    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.errors import ContextWindowError

    classes = {"llama_index": LlamaIndexPipeline, "langchain": LangChainPipeline,
               "langchain_system": LangChainSystemPipeline}
    rows: list[dict] = []
    # Every reply goes to --out as it comes, one flushed line each: a run that is stopped (a
    # long CPU run over 72 items is an hour or more) leaves every reply it made.
    sink = open(args.out, "w", encoding="utf-8") if args.out else None

    def emit(row: dict) -> None:
        rows.append(row)
        if sink is not None:
            sink.write(json.dumps(row, ensure_ascii=False) + "\n")
            sink.flush()

    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    with contextlib.closing(sink) if sink else contextlib.nullcontext(), \
            tempfile.TemporaryDirectory(prefix="turborag-pipelines-",
                                        ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        store = args.store if args.store is not None else workdir / "kv"
        kwargs = {"store": str(store), "progress": False, **engine_args}
        engine = TurboRAGEngine(args.model, **kwargs)
        runners = [classes[p](engine, workdir, args.max_new_tokens, args.order,
                              args.lead_blobs == "on") for p in pipelines]
        engine.warmup()
        if k is not None:  # one shared collection per pipeline, ingested once, not timed
            for runner in runners:
                log(f"{runner.name}: ingesting {len(corpus)} distinct chunks of {args.data} "
                    f"into one collection (top-{k} retrieval)")
                start = time.perf_counter()
                runner.prepare(corpus, collection="corpus", k=min(k, len(corpus)),
                               progress=not args.json, sources=sources)
                log(f"{runner.name}: ingested in {time.perf_counter() - start:.1f}s")
        for i, item in enumerate(items):
            for runner in runners:
                if k is None:
                    runner.prepare(item["chunks"], collection=f"item{i:05d}",
                                   k=len(item["chunks"]),
                                   sources=[item["id"]] * len(item["chunks"]))
                for mode, recovery in asked:
                    name = variant_name(mode, recovery)
                    try:
                        if i == 0:  # untimed warm-up
                            runner.answer(item["question"], mode, recovery)
                        reply, stats, retrieved = runner.answer(item["question"], mode, recovery)
                    except ContextWindowError as exc:
                        emit({"id": item["id"], "pipeline": runner.name, "mode": mode,
                              "recovery": recovery, "unanswerable": item["unanswerable"],
                              "error": str(exc)})
                        log(f"[{i + 1}/{len(items)}] {item['id']} {runner.name} {name}: {exc}")
                        continue
                    reply = reply.strip()
                    correct, refusal = judge(reply, item)
                    emit({
                        "id": item["id"], "pipeline": runner.name, "mode": mode,
                        "recovery": recovery,
                        "question": item["question"], "answers": item["answers"],
                        "unanswerable": item["unanswerable"], "reply": reply,
                        "correct": correct, "refusal": refusal,
                        "retrieved_chunks": len(retrieved),
                        "gold_retrieved": gold_retrieved(item, retrieved),
                        "retrieved_from": placed(retrieved, places),
                        **{key: stats.get(key) for key in (
                            "ttft_s", "prompt_tokens", "reused_tokens", "prefilled_tokens",
                            "recomputed_tokens", "recovery_s", "cache_hits", "cache_misses",
                            "new_tokens", "finish_reason")},
                        "lead_blob": bool(stats.get("lead_blob"))})
                    gold = {True: "yes", False: "no", None: "—"}[rows[-1]["gold_retrieved"]]
                    log(f"[{i + 1}/{len(items)}] {item['id']} {runner.name:<11} {name:<12} "
                        f"{'ok ' if correct else 'bad'} gold {gold:<3} "
                        f"ttft {stats.get('ttft_s', 0):.3f}s "
                        f"reused {stats.get('reused_tokens')}/{stats.get('prompt_tokens')} "
                        f"hits {stats.get('cache_hits')}  {reply[:70]!r}")
        dtype = engine.fingerprint.dtype

    results = summarise(rows, pipelines, asked)
    settings = {"data": str(args.data), "model": args.model, "dtype": dtype,
                "engine_args": engine_args,
                "recovery": args.recovery[0] if len(args.recovery) == 1 else args.recovery or None,
                "order": args.order,
                "lead_blobs": args.lead_blobs,
                "pipelines": pipelines,
                "store": None if args.store is None else str(args.store),
                "corpus": "per-item" if k is None else "shared", "k": k,
                "corpus_chunks": (sum(len(it["chunks"]) for it in items) if k is None
                                  else len(corpus)),
                "max_new_tokens": args.max_new_tokens, "stop": list(STOP), "limit": args.limit,
                "items": len(items), "answerable": sum(not it["unanswerable"] for it in items),
                "unanswerable": sum(it["unanswerable"] for it in items),
                "load_errors": [{"line": n, "reason": r} for n, r in load_errors]}
    if args.json:
        print(json.dumps({**settings, "results": results}))
        return 0
    print_table(results, settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
