"""A small RAG chat web app over an ingested folder: TurboRAG answers, streamed, next to the
TTFT a full prefill of the same prompt would take.

    turborag ingest docs/                     # once
    python examples/webapp/app.py             # then open http://127.0.0.1:8000

Server-sent events from /api/ask: `delta` events carry answer text as it is generated, then one
`done` event carries the sources and the figures. Settings come from the environment:
TURBORAG_WORKSPACE (the folder `turborag ingest` used), TURBORAG_WEBAPP_COMPARE=0 to skip the
full-prefill timing.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse, StreamingResponse

from turborag_integrations.core.errors import TurboRAGError
from turborag_integrations.core.generate import GenerationConfig
from turborag_integrations.workspace import Workspace

STATIC = Path(__file__).parent / "static"


def create_app(workspace: Workspace, *, compare: bool = True, max_new_tokens: int = 96) -> FastAPI:
    app = FastAPI(title="TurboRAG chat")
    lock = threading.Lock()  # one generation at a time: the model runs on all cores anyway
    workspace.engine.warmup()

    def sse(event: str, data: dict) -> str:
        return f"event: {event}\ndata: {json.dumps(data)}\n\n"

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html")

    @app.get("/api/ask")
    def ask(q: str = Query(..., min_length=1), k: int = 4):
        def events():
            with lock:
                try:
                    answer = workspace.ask(q, k=k, config=GenerationConfig(max_new_tokens=max_new_tokens))
                    for delta in answer:
                        yield sse("delta", {"text": delta})
                    stats = answer.stats
                    done = {"sources": [{"path": s.path, "score": round(s.score, 3),
                                         "text": s.text[:300]} for s in answer.sources],
                            "ttft_ms": stats.ttft_s * 1000,
                            "reused_tokens": stats.reused_tokens,
                            "prompt_tokens": stats.prompt_tokens}
                    if compare:
                        done["full_prefill_ttft_ms"] = workspace.full_prefill_ttft(answer) * 1000
                    yield sse("done", done)
                except TurboRAGError as exc:
                    yield sse("failure", {"message": str(exc)})

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    return app


def main(argv=None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="TurboRAG chat web app")
    ap.add_argument("--store", help="workspace folder (default: TURBORAG_WORKSPACE or ~/.cache)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--no-compare", action="store_true", help="skip the full-prefill timing")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    compare = not args.no_compare and os.environ.get("TURBORAG_WEBAPP_COMPARE", "1") != "0"
    app = create_app(Workspace(args.store), compare=compare, max_new_tokens=args.max_new_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
