"""Answer accuracy of stock LlamaIndex and LangChain RAG pipelines, TurboRAG vs full prefill.

    python benchmarks/pipelines.py                                   # the held-out set
    python benchmarks/pipelines.py turborag_integrations/data/devset/test.jsonl --limit 3
    python benchmarks/pipelines.py --pipelines langchain --engine-arg positions=composite --json
    python benchmarks/pipelines.py --out answers.jsonl               # every reply, one per line

Each item of the JSONL set ({"id", "question", "answers": [...], "chunks": [...],
"unanswerable": bool}) gets its own small corpus, one node / document per chunk (no further
splitting), in a fresh collection of an embedded Chroma (bundled MiniLM embeddings) behind our
KVCachingVectorStore, which stores each chunk's KV blob at ingestion. Then every chunk is
retrieved (top-k = number of chunks) and answered by:

- llama_index: `index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()],
  similarity_top_k=k)`, default (compact) response mode and default templates;
- langchain: `{"context": retriever | format_docs, "question": RunnablePassthrough()} | prompt |
  chat_model | StrOutputParser()` with the common RAG prompt ("You are an assistant for
  question-answering tasks. ...").

Each pipeline answers twice with one and the same query engine / chain: the LLM in mode "turbo"
(stitched chunk KV caches) and in mode "naive" (full prefill). Decoding is greedy and stops at a
blank line or after --max-new-tokens. An answerable item is correct when a normalised answer occurs
in the reply; an item marked "unanswerable" is correct when the reply declines (is_refusal). Time
to first token and reused tokens come from the LLM's own stats (model side: chunk lookup, blob
loading, stitching and prefill; not retrieval). The first item is answered once untimed in each
mode and pipeline before it is measured, so one-off costs (the template head's blob) are not
counted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("ANONYMIZED_TELEMETRY", "False")  # Chroma: no telemetry attempts offline

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "turborag_integrations" / "data" / "heldout" / "heldout.jsonl"
PIPELINES = ("llama_index", "langchain")
MODES = ("naive", "turbo")  # full prefill first: the baseline of each item
MODE_NAMES = {"naive": "full prefill", "turbo": "TurboRAG"}
STOP = ("\n\n",)  # a blank line ends the answer
LANGCHAIN_RAG_PROMPT = (
    "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
    "context to answer the question. If you don't know the answer, just say that you don't know. "
    "Use three sentences maximum and keep the answer concise.\nQuestion: {question} \n"
    "Context: {context} \nAnswer:")


# ---- data -------------------------------------------------------------------------------------
def load_jsonl(path: Path) -> tuple[list[dict], list[tuple[int, str]]]:
    """Items (as dicts) and (line number, reason) for each malformed line: the harness's reader,
    so both judge the same lines the same way."""
    from turborag_integrations.evaluation.harness import load_items

    report = load_items(path)
    items = [{"id": it.id, "question": it.question, "answers": it.answers, "chunks": it.chunks,
              "unanswerable": it.unanswerable, "line": it.line} for it in report.items
             if it.chunks]
    return items, report.errors


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
    """The stock query engine over one item's nodes; the LLM's mode picks the path."""

    name = "llama_index"

    def __init__(self, engine, workdir: Path, max_new_tokens: int):
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding

        from turborag_integrations.core.retrieval.embedding import default_embedding_path
        from turborag_integrations.llama_index import TurboRAGLLM

        self.engine = engine
        self.path = workdir / "chroma_llama_index"
        self.embed_model = HuggingFaceEmbedding(model_name=default_embedding_path())
        self.llm = TurboRAGLLM(engine, max_new_tokens=max_new_tokens, temperature=0.0,
                               stop=list(STOP))
        self.postprocessor = self.llm.postprocessor()
        self.query_engine = None

    def prepare(self, item: dict, collection: str) -> None:
        from llama_index.core import StorageContext, VectorStoreIndex
        from llama_index.core.schema import TextNode

        from turborag_integrations.llama_index import KVCachingVectorStore

        store = KVCachingVectorStore(self.engine, path=self.path, collection=collection,
                                     show_progress=False)
        nodes = [TextNode(text=c, id_=f"{collection}-{j}") for j, c in enumerate(item["chunks"])]
        index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(
            vector_store=store), embed_model=self.embed_model)
        self.query_engine = index.as_query_engine(
            llm=self.llm, node_postprocessors=[self.postprocessor],
            similarity_top_k=len(item["chunks"]))

    def answer(self, question: str, mode: str) -> tuple[str, dict]:
        self.llm.mode = mode  # the same LLM object, so the same query engine serves both modes
        response = self.query_engine.query(question)
        return (response.response or ""), dict(self.llm.last_stats or {})


class LangChainPipeline:
    """The stock LCEL RAG chain over one item's documents; the chat model's mode picks the path."""

    name = "langchain"

    def __init__(self, engine, workdir: Path, max_new_tokens: int):
        from langchain_core.prompts import ChatPromptTemplate

        from turborag_integrations.langchain import (SentenceTransformerEmbeddings,
                                                     TurboRAGChatModel)

        self.engine = engine
        self.path = workdir / "chroma_langchain"
        self.embeddings = SentenceTransformerEmbeddings()
        self.prompt = ChatPromptTemplate.from_template(LANGCHAIN_RAG_PROMPT)
        self.chat_model = TurboRAGChatModel(engine=engine, max_tokens=max_new_tokens,
                                            temperature=0.0, stop=list(STOP))
        self.chains = {}

    @staticmethod
    def format_docs(docs) -> str:
        return "\n\n".join(d.page_content for d in docs)

    def prepare(self, item: dict, collection: str) -> None:
        from langchain_core.output_parsers import StrOutputParser
        from langchain_core.runnables import RunnablePassthrough

        from turborag_integrations.langchain import KVCachingVectorStore

        store = KVCachingVectorStore(engine=self.engine, embedding=self.embeddings,
                                     persist_directory=str(self.path), collection_name=collection)
        store.add_texts(item["chunks"], ids=[f"{collection}-{j}" for j in
                                             range(len(item["chunks"]))])
        retriever = store.as_retriever(search_kwargs={"k": len(item["chunks"])})
        context = {"context": retriever | self.format_docs, "question": RunnablePassthrough()}
        # One chain per mode, differing only in the `mode` bound to the same chat model.
        self.chains = {mode: context | self.prompt | self.chat_model.bind(mode=mode)
                       | StrOutputParser() for mode in MODES}

    def answer(self, question: str, mode: str) -> tuple[str, dict]:
        from turborag_integrations.langchain import TurboRAGRunCollector

        run = TurboRAGRunCollector()
        reply = self.chains[mode].invoke(question, config={"callbacks": [run]})
        return reply, dict(run.stats)


# ---- scoring ----------------------------------------------------------------------------------
def judge(reply: str, item: dict) -> tuple[bool, bool]:
    """(correct, refusal) of one reply."""
    from turborag_integrations.evaluation.metrics import is_refusal, score

    refusal = is_refusal(reply)
    if item["unanswerable"]:
        return refusal, refusal
    return bool(score(reply, item["answers"])["contains"]), refusal


def summarise(rows: list[dict], pipelines: list[str]) -> list[dict]:
    out = []
    for pipeline in pipelines:
        ttft = {}
        for mode in MODES:
            rs = [r for r in rows if r["pipeline"] == pipeline and r["mode"] == mode
                  and "error" not in r]
            ans = [r for r in rs if not r["unanswerable"]]
            una = [r for r in rs if r["unanswerable"]]
            med = statistics.median([r["ttft_s"] for r in rs]) if rs else None
            ttft[mode] = med
            out.append({
                "pipeline": pipeline, "mode": mode, "n": len(rs),
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
                "median_prompt_tokens": (statistics.median([r["prompt_tokens"] for r in rs])
                                         if rs else None),
                "median_reused_tokens": (statistics.median([r["reused_tokens"] for r in rs])
                                         if rs else None),
                "errors": sum(1 for r in rows if r["pipeline"] == pipeline and r["mode"] == mode
                              and "error" in r),
            })
        for r in out[-len(MODES):]:
            # full-prefill TTFT / this mode's TTFT: > 1 means faster than full prefill
            r["speedup"] = (ttft["naive"] / r["median_ttft_s"]
                            if ttft["naive"] and r["median_ttft_s"] else None)
        # How often the two modes gave the same (normalised) reply.
        from turborag_integrations.evaluation.metrics import normalize

        by = {(r["id"], r["mode"]): normalize(r["reply"]) for r in rows
              if r["pipeline"] == pipeline and "error" not in r}
        ids = {i for i, m in by if m == "turbo" and (i, "naive") in by}
        same = sum(by[(i, "turbo")] == by[(i, "naive")] for i in ids)
        for r in out[-len(MODES):]:
            r["same_reply_as_full_pct"] = 100 * same / len(ids) if ids else None
    return out


def print_table(results: list[dict], settings: dict) -> None:
    print(f"{settings['items']} items from {settings['data']} ({settings['answerable']} "
          f"answerable, {settings['unanswerable']} unanswerable); model {settings['model']}; "
          f"engine args {settings['engine_args'] or '{}'}; greedy, ≤{settings['max_new_tokens']} "
          "new tokens, stop at a blank line")
    head = (f"{'pipeline':<12} {'mode':<13} {'answerable correct':>19} {'refused':>8} "
            f"{'unanswerable refused':>21} {'total correct':>14} {'median TTFT s':>14} "
            f"{'speed-up':>9} {'reused/prompt tok':>18}")
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
        print(f"{r['pipeline']:<12} {MODE_NAMES[r['mode']]:<13} {ans:>19} {ref:>8} {una:>21} "
              f"{pct(r['total_correct_pct']):>14} {med:>14} {sp:>9} {tok:>18}")
    print("refused: answerable items the reply declined; speed-up: full-prefill median TTFT / "
          "this mode's; reused/prompt tok: medians")
    for r in results:
        if r["mode"] == "turbo" and r["same_reply_as_full_pct"] is not None:
            print(f"{r['pipeline']}: TurboRAG reply equals the full-prefill reply on "
                  f"{r['same_reply_as_full_pct']:.1f}% of items")
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
                    help=f"comma-separated, from {', '.join(PIPELINES)} (default: both)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, help="write every reply as JSONL to this file")
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
    engine_args = {}
    for spec in args.engine_arg:
        key, sep, value = spec.partition("=")
        if not sep or not key.strip():
            ap.error(f"--engine-arg expects KEY=VALUE, got {spec!r}")
        engine_args[key.strip()] = parse_value(value)
    if not args.data.is_file():
        ap.error(f"no such file: {args.data} (give a JSONL set, e.g. "
                 "turborag_integrations/data/devset/test.jsonl)")

    items, load_errors = load_jsonl(args.data)
    for n, reason in load_errors:
        print(f"{args.data}:{n}: skipped: {reason}", file=sys.stderr)
    items = items[:args.limit] if args.limit else items
    if not items:
        print(f"error: no usable items in {args.data}", file=sys.stderr)
        return 1

    from turborag_integrations.core.engine import TurboRAGEngine
    from turborag_integrations.core.errors import ContextWindowError

    classes = {"llama_index": LlamaIndexPipeline, "langchain": LangChainPipeline}
    rows: list[dict] = []
    log = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    with tempfile.TemporaryDirectory(prefix="turborag-pipelines-",
                                     ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        kwargs = {"store": str(workdir / "kv"), "progress": False, **engine_args}
        engine = TurboRAGEngine(args.model, **kwargs)
        runners = [classes[p](engine, workdir, args.max_new_tokens) for p in pipelines]
        engine.warmup()
        for i, item in enumerate(items):
            for runner in runners:
                runner.prepare(item, collection=f"item{i:05d}")
                for mode in MODES:
                    try:
                        if i == 0:
                            runner.answer(item["question"], mode)  # untimed warm-up
                        reply, stats = runner.answer(item["question"], mode)
                    except ContextWindowError as exc:
                        rows.append({"id": item["id"], "pipeline": runner.name, "mode": mode,
                                     "unanswerable": item["unanswerable"], "error": str(exc)})
                        log(f"[{i + 1}/{len(items)}] {item['id']} {runner.name} {mode}: {exc}")
                        continue
                    reply = reply.strip()
                    correct, refusal = judge(reply, item)
                    rows.append({
                        "id": item["id"], "pipeline": runner.name, "mode": mode,
                        "question": item["question"], "answers": item["answers"],
                        "unanswerable": item["unanswerable"], "reply": reply,
                        "correct": correct, "refusal": refusal,
                        **{k: stats.get(k) for k in ("ttft_s", "prompt_tokens", "reused_tokens",
                                                     "prefilled_tokens", "cache_hits",
                                                     "cache_misses", "new_tokens",
                                                     "finish_reason")}})
                    log(f"[{i + 1}/{len(items)}] {item['id']} {runner.name:<11} {mode:<5} "
                        f"{'ok ' if correct else 'bad'} ttft {stats.get('ttft_s', 0):.3f}s "
                        f"reused {stats.get('reused_tokens')}/{stats.get('prompt_tokens')} "
                        f"hits {stats.get('cache_hits')}  {reply[:70]!r}")
        dtype = engine.fingerprint.dtype

    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    results = summarise(rows, pipelines)
    settings = {"data": str(args.data), "model": args.model, "dtype": dtype,
                "engine_args": engine_args, "pipelines": pipelines,
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
