"""The FastAPI app: OpenAI's completion endpoints over a TurboRAGEngine, plus chunk ingestion,
health and metrics.

    app = create_app(engine)              # or: turborag serve --model ... --store ...

    POST /v1/chat/completions, /v1/completions    OpenAI's bodies; "stream": true for SSE
    POST /v1/turborag/chunks                      {"texts": [...]}: encode blobs, index texts
    GET  /v1/models, /health, /metrics            (metrics: Prometheus text format)

A prompt reuses the stored blob of every indexed chunk text it contains verbatim, with nothing
added to the request (finder.py says how they are found); `turborag_chunks` in a request names
more. Errors come as OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.engine import TurboRAGEngine
from ..core.registry import ChunkRegistry
from .finder import ChunkFinder
from .metrics import CONTENT_TYPE, CountRequests, Metrics
from .responses import APIError, Reply
from .schemas import ChatCompletionRequest, ChunksRequest, CompletionRequest
from .service import Service
from .worker import Worker

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/turborag/chunks", "/v1/models",
             "/health", "/metrics")


def param_name(loc: tuple) -> str | None:
    """A pydantic error location as OpenAI names parameters: "messages[0].role"."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else f".{part}" if name else str(part)
    return name or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first problem of a request body that does not fit its schema, as a 400."""
    errors = exc.errors()
    error = errors[0]
    # A value that fits none of a union's types fails once per type, each with the type's name
    # appended to the location: name the part all those failures share.
    loc = [part for part in error["loc"] if part != "body"]
    for other in errors[1:]:
        theirs = [part for part in other["loc"] if part != "body"]
        if theirs[:1] == loc[:1]:
            shared = next((i for i, (a, b) in enumerate(zip(loc, theirs)) if a != b),
                          min(len(loc), len(theirs)))
            loc = loc[:shared]
    param = param_name(tuple(loc))
    kind = error["type"]
    if kind == "json_invalid":
        message = "the request body is not valid JSON"
    elif param is None:
        message = "the request body must be a JSON object, sent as application/json"
    elif kind == "missing":
        message = f"{param} is required"
    else:
        message = f"{param}: {error['msg']}"
    return APIError(400, message, param=param, code=kind)


def create_app(engine: TurboRAGEngine, *, registry: ChunkRegistry | None = None,
               model_name: str | None = None, default_max_tokens: int | None = None) -> FastAPI:
    """The server over `engine`.

    registry: where adapters in this process record chunk texts, followed by the server's
    lookup (default: the engine's own, `ChunkRegistry.for_engine`). model_name: the name
    clients must send as `model` (default: the engine's model). default_max_tokens: the limit
    of a chat completion that sets none (default: the rest of the context window).

    The app runs one engine call at a time; two apps over one engine would not know of each
    other's calls, so serve an engine from one app.
    """
    finder = ChunkFinder(registry if registry is not None else ChunkRegistry.for_engine(engine))
    worker = Worker()
    metrics = Metrics(queue_depth=lambda: worker.waiting, engine_busy=lambda: int(worker.busy),
                      indexed_chunks=lambda: len(finder))
    service = Service(engine, finder, worker, metrics, model_name=model_name or engine.loaded.name,
                      default_max_tokens=default_max_tokens)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        worker.close()

    app = FastAPI(title="TurboRAG", summary="OpenAI-compatible completions that reuse chunk KV "
                  "caches", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(CountRequests, metrics=metrics, endpoints=ENDPOINTS)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        response = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                            code=str(exc.status_code)).response()
        response.headers.update(exc.headers or {})
        return response

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        service.check(req)
        try:
            prompt = engine.render_chat(req.chat())
        except Exception as exc:  # the model's template refuses some turn orders and roles
            raise APIError(400, f"the model's chat template refused these messages: {exc}",
                           param="messages") from None
        return await service.complete(request, req, prompt,
                                      Reply(chat=True, model=service.model_name))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        service.check(req)
        return await service.complete(request, req, req.text(),
                                      Reply(chat=False, model=service.model_name))

    @app.post("/v1/turborag/chunks")
    async def ingest_chunks(req: ChunksRequest, request: Request):
        return await service.ingest(request, req)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model",
                                            "created": started, "owned_by": "turborag"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": service.model_name, "queue_depth": worker.waiting,
                "engine_busy": worker.busy, "indexed_chunks": len(finder)}

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    return app


def serve(*, model: str | None = None, store: str | Path | None = None,
          host: str = "127.0.0.1", port: int = 8000, adapter: str | None = "default") -> None:
    """Load the engine, warm it up, and serve it with uvicorn until interrupted."""
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    with TurboRAGEngine(model, store=store, adapter=adapter) as engine:
        engine.warmup()
        uvicorn.run(create_app(engine), host=host, port=port, log_level="info")
