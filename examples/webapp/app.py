"""A small RAG chat web app over an ingested folder: TurboRAG answers, streamed, next to the
TTFT a full prefill of the same prompt would take.

    turborag ingest docs/                     # once
    python examples/webapp/app.py             # then open http://127.0.0.1:8080

POST /api/ask with a JSON body {"question": "...", "k": 4, "compare": true} answers with
server-sent events: `delta` events carry answer text as it is generated, then one `done` event
carries the sources and the figures (with "compare", the full prefill's own answer to the same
prompt and its TTFT, shown beside TurboRAG's); GET /api/info names the model and the ingested
documents; `failure` carries a message when answering failed, and
`queued` says the question waits for another one to finish (the model answers one at a time).
A question whose client leaves is cancelled: decoding stops and the model is free for the next.

Bad input is answered 422 with {"message": ...}. The server answers only requests addressed to
the host it listens on or to a localhost name (`--allow-host` adds names), and only from its own
page or from clients that send no Origin (curl, scripts): any other web page the user has open
could otherwise drive it. Settings come from the environment: TURBORAG_WORKSPACE (the folder
`turborag ingest` used), TURBORAG_WEBAPP_COMPARE=0 to skip the full-prefill timing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from contextlib import aclosing
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import urlsplit

try:
    import anyio
    from fastapi import FastAPI, Request
    from sse_starlette import EventSourceResponse
except ImportError as exc:  # the default install has no web framework
    raise SystemExit(f"{exc}: the web app needs FastAPI and uvicorn; install them with "
                     "`bash scripts/install.sh webapp` (or pip install "
                     "'turborag-integrations[webapp]')") from None
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from turborag_integrations.core.errors import TurboRAGError
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.workspace import Workspace

try:
    from turborag_integrations.core.async_iter import iterate_in_thread
except ImportError:
    from turborag_integrations.core.async_iter import iterate_in_thread

STATIC = Path(__file__).parent / "static"
MAX_K = 20  # passages per question; the page's number field uses the same bounds
MAX_QUESTION_CHARS = 2000
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::")
QUEUE_POLL_S = 0.2  # how often a waiting question checks that its client is still there

log = logging.getLogger("turborag.webapp")


class AskRequest(BaseModel):
    """The body of POST /api/ask."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    question: str = Field(min_length=1, max_length=MAX_QUESTION_CHARS)
    k: int = Field(4, ge=1, le=MAX_K, strict=True)  # strict: 4.5, "4" and true are refused
    compare: bool = Field(True, strict=True)  # also time a full prefill (if the server does)


def describe(error: dict) -> str:
    """One validation error of AskRequest, in words a user of the page can act on."""
    kind = error["type"]
    field = ".".join(str(part) for part in error["loc"] if part != "body")
    if kind == "json_invalid":
        return "the request body is not valid JSON"
    if not field:
        return ('the request body must be a JSON object such as {"question": "...", "k": 4}, '
                "sent with Content-Type: application/json")
    if kind == "missing":
        return f"{field} is missing"
    if kind == "extra_forbidden":
        return f"unknown field {field!r} (known: {', '.join(AskRequest.model_fields)})"
    if field == "question":
        if kind == "string_too_short":
            return "the question is empty"
        if kind == "string_too_long":
            return f"the question is longer than {MAX_QUESTION_CHARS} characters"
        return "the question must be a string"
    if field == "k":
        return f"k must be a whole number from 1 to {MAX_K}"
    if field == "compare":
        return "compare must be true or false"
    return f"{field}: {error['msg']}"


def host_name(authority: str) -> str | None:
    """The host name of a Host header value or URL authority ("[::1]:8000" -> "::1")."""
    try:
        return urlsplit("//" + authority).hostname
    except ValueError:
        return None


def same_origin(origin: str, scheme: str, host: str) -> bool:
    """Whether a browser's Origin header names this server as the request reached it."""
    port = {"http": 80, "https": 443}.get(scheme)  # what a URL without a port means
    try:
        theirs = urlsplit(origin)
        ours = urlsplit(f"{scheme}://{host}")
        return (theirs.scheme == scheme and theirs.hostname is not None
                and theirs.hostname == ours.hostname
                and (theirs.port or port) == (ours.port or port))
    except ValueError:  # a malformed header or port
        return False


class LocalOnly:
    """ASGI middleware that refuses (403) requests a local server should not take.

    Host: a page on evil.example can re-point its own name at 127.0.0.1 (DNS rebinding); its
    requests then reach this server as same-origin, but with `Host: evil.example`.
    Origin: any page the user has open may send requests to 127.0.0.1; browsers name the page
    that sent one in Origin. Clients that are not browsers (curl, scripts) send none and pass.
    """

    def __init__(self, app, allowed_hosts: Iterable[str]):
        self.app = app
        self.allowed_hosts = {h.strip("[]").lower() for h in allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        origin = headers.get("origin")
        if host_name(host) not in self.allowed_hosts:
            message = (f"this server does not answer requests addressed to {host!r}; it answers "
                       f"to {', '.join(sorted(self.allowed_hosts))} (start it with --allow-host "
                       "NAME to add a name)")
        elif origin is not None and not same_origin(origin, scope["scheme"], host):
            message = (f"requests from other web pages are refused (Origin: {origin}); open "
                       f"{scope['scheme']}://{host}/ and ask there")
        else:
            return await self.app(scope, receive, send)
        await JSONResponse({"message": message}, status_code=403)(scope, receive, send)


class EventStream(EventSourceResponse):
    """Server-sent events whose generator is closed however the response ends.

    When the client disconnects, the response is cancelled but the body generator is left
    suspended where it was; closing it is what cancels the generation behind it. No keep-alive
    comments: an answer's events come at least every token.
    """

    def __init__(self, events):
        super().__init__(events, headers={"Cache-Control": "no-cache"}, ping=0, sep="\n")

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # the response may be cancelled already
                await self.body_iterator.aclose()


def sse(event: str, data: dict) -> dict:
    """One server-sent event, as sse-starlette writes it: `event: NAME` and `data: JSON`."""
    return {"event": event, "data": json.dumps(data)}


def create_app(workspace: Workspace, *, compare: bool = True, max_new_tokens: int = 96,
               allowed_hosts: Iterable[str] = LOCAL_HOSTS) -> FastAPI:
    """The web app over `workspace`. compare=False never times a full prefill; allowed_hosts
    are the host names it answers to (see LocalOnly)."""
    app = FastAPI(title="TurboRAG chat")
    app.add_middleware(LocalOnly, allowed_hosts=allowed_hosts)
    # One generation at a time: the model runs on all cores anyway. It is taken and released in
    # the worker thread that runs the generation (see answer_events).
    lock = threading.Lock()
    workspace.engine.warmup()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        errors = [{"field": ".".join(str(p) for p in e["loc"] if p != "body"),
                   "message": describe(e)} for e in exc.errors()]
        return JSONResponse({"message": "; ".join(e["message"] for e in errors), "errors": errors},
                            status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = str(exc.detail)
        if exc.status_code == 405:
            message = (f"{request.method} is not allowed on {request.url.path}; use "
                       f"{(exc.headers or {}).get('Allow', 'another method')}")
        return JSONResponse({"message": message}, status_code=exc.status_code,
                            headers=exc.headers)

    def answer_events(req: AskRequest) -> Iterator[tuple[str, dict] | None]:
        """The events of one answer, made in a worker thread (the engine blocks).

        Yields None where there is nothing to send but the consumer should get the chance to
        stop it (iterate_in_thread stops at the next item once its consumer has gone): while
        waiting for the lock, once it is taken, and before the full-prefill timing. Closing
        this generator closes the engine's stream (decoding stops, its cache is released) and
        releases the lock.
        """
        if not lock.acquire(blocking=False):
            yield "queued", {"message": "Waiting for the question before this one to finish…"}
            while not lock.acquire(timeout=QUEUE_POLL_S):
                yield None
        try:
            yield None  # a client that left while this question waited costs no prefill
            started = time.perf_counter()
            answer = None
            try:
                answer = workspace.ask(req.question, k=req.k,
                                       config=GenerationConfig(max_new_tokens=max_new_tokens))
                for delta in answer:
                    yield "delta", {"text": delta}
            finally:
                if answer is not None:
                    answer.stream.close()  # no-op once it has run to its end
                    stats = answer.stats
                    log.info("answer to %r: %s after %d tokens, %.1f s", req.question[:60],
                             stats.finish_reason if stats else "failed",
                             stats.new_tokens if stats else 0, time.perf_counter() - started)
            stats = answer.stats
            done = {"sources": [{"path": s.path, "score": round(s.score, 3), "text": s.text[:300]}
                                for s in answer.sources],
                    "ttft_ms": stats.ttft_s * 1000,
                    "reused_tokens": stats.reused_tokens,
                    "prompt_tokens": stats.prompt_tokens,
                    "finish_reason": stats.finish_reason}
            if compare and req.compare:
                yield None  # a client gone by now is not worth a full prefill
                # the whole answer, not only its TTFT: a fast answer is worth showing only
                # beside the one the model gives with everything prefilled
                full = workspace.full_prefill(answer, GenerationConfig(
                    max_new_tokens=max_new_tokens))
                done["full_prefill_ttft_ms"] = full.stats.ttft_s * 1000
                done["full_prefill_answer"] = full.text
            yield "done", done
        except TurboRAGError as exc:
            yield "failure", {"message": str(exc)}
        except Exception as exc:  # anything else still ends the page's wait with a message
            log.exception("answering %r failed", req.question[:60])
            yield "failure", {"message": "the server failed to answer: "
                                         f"{type(exc).__name__}: {exc}"}
        finally:
            lock.release()

    @app.get("/")
    def index():
        return FileResponse(STATIC / "index.html")

    about = {"model": workspace.model_name, "documents": workspace.documents(),
             "workspace": str(workspace.root)}

    @app.get("/api/info")
    def info():
        """What the answers come from: the model and the ingested documents."""
        return about

    @app.post("/api/ask")
    async def ask(req: AskRequest, request: Request):
        async def events():
            stream = iterate_in_thread(lambda: answer_events(req))
            async with aclosing(stream):  # closing it stops the worker thread's generation
                async for item in stream:
                    if await request.is_disconnected():
                        return
                    if item is not None:
                        yield sse(*item)

        return EventStream(events())

    return app


def allowed_host_names(bind: str, extra: Iterable[str] = ()) -> list[str]:
    """The localhost names, the host the server listens on (unless it is a wildcard) and
    `extra`."""
    names = [*LOCAL_HOSTS, *extra]
    if bind not in WILDCARD_HOSTS:
        names.append(bind)
    return names


def main(argv=None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description="TurboRAG chat web app")
    ap.add_argument("--workspace", type=Path, help="workspace folder: the manifest, the chunk "
                    "index and the KV store (default ~/.cache/turborag/workspace or "
                    "$TURBORAG_WORKSPACE)")
    ap.add_argument("--host", default="127.0.0.1")
    # 8080: apart from turborag serve (8000), turborag vllm (8100) and the Chroma server the
    # docs suggest (8200)
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                    help="also answer requests addressed to NAME (e.g. this machine's name on "
                         "the network, with --host 0.0.0.0); repeatable")
    ap.add_argument("--no-compare", action="store_true", help="skip the full-prefill timing")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.host in WILDCARD_HOSTS and not args.allow_host:
        log.warning("listening on all interfaces, but answering only requests addressed to "
                    "localhost: add --allow-host NAME for the name other machines use")
    compare = not args.no_compare and os.environ.get("TURBORAG_WEBAPP_COMPARE", "1") != "0"
    app = create_app(Workspace(args.workspace), compare=compare,
                     max_new_tokens=args.max_new_tokens,
                     allowed_hosts=allowed_host_names(args.host, args.allow_host))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
