"""The FastAPI app: OpenAI's completion endpoints over a TurboRAGEngine, plus chunk ingestion,
health and metrics.

    app = create_app(engine, max_batch=8)  # or: turborag serve --model ... --store ...

    POST /v1/chat/completions, /v1/completions    OpenAI's bodies; "stream": true for SSE
    POST /v1/turborag/chunks                      {"texts": [...]}: encode blobs, index texts
    GET  /v1/models, /health, /metrics            (metrics: Prometheus text format)

A prompt reuses the stored blob of every indexed chunk text it contains verbatim, with nothing
added to the request (finder.py says how they are found); `turborag_chunks` in a request names
more. Completions are decoded together by a `BatchScheduler` (core/batching.py) that owns the
model. Errors come as OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Sequence

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.batching import BatchScheduler, on_own_thread
from ..core.engine import TurboRAGEngine
from ..core.prompt_template import Template, render_prompt_template
from ..core.registry import ChunkRegistry
from ..core.settings import DEFAULT_RECOVERY, MODES, check_choice
from .finder import ChunkFinder
from .guards import Authenticate, LimitBody
from .keys import KeyFile
from .metrics import CONTENT_TYPE, CountRequests, Metrics
from .responses import APIError, Reply
from .schemas import ChatCompletionRequest, ChunksRequest, CompletionRequest
from .service import Service

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/turborag/chunks", "/v1/models",
             "/health", "/metrics")
MAX_BATCH = 8
MAX_QUEUE = 64
MAX_BODY_BYTES = 8 * 2**20  # 8 MiB: a 32K-token prompt is ≈128 KB; ingestion batches are larger
BODY_TIMEOUT_S = 30.0  # to receive a whole body: 8 MiB at 2 Mbit/s


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
               model_name: str | None = None, default_max_tokens: int | None = None,
               mode: str = "turbo", max_batch: int = MAX_BATCH, max_queue: int = MAX_QUEUE,
               max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None,
               keys: KeyFile | None = None, body_timeout_s: float = BODY_TIMEOUT_S) -> FastAPI:
    """The server over `engine`.

    registry: where adapters in this process record chunk texts, followed by the server's
    lookup (default: the engine's own, `ChunkRegistry.for_engine`). model_name: the name
    clients must send as `model` (default: the engine's model). default_max_tokens: the limit
    of a chat completion that sets none (default: the rest of the context window). mode:
    "turbo", or "naive" to prefill every prompt whole (no reuse: the baseline), for requests
    that do not set `turborag_mode`. max_batch: requests decoded together. max_queue: requests
    that may wait for the model; more get a 429. max_body_bytes: larger bodies get a 413.
    body_timeout_s: a body not received whole within it gets a 408.
    api_key: when set, every /v1/ request must send `Authorization: Bearer <api_key>`.
    keys: instead of one key, a keys file of tenants' keys (keys.py): each request works in its
    tenant's namespace of the store and index (service.py), /metrics needs an admin key and
    counts per tenant, and /health says only that the server is up.

    The app's `BatchScheduler` (`app.state.scheduler`) owns the model from now on and stops
    when the app shuts down: run nothing else on the engine meanwhile (`scheduler.call` runs a
    function on its thread), and serve an engine from one app.
    """
    check_choice("mode", mode, MODES)
    for name, value in (("max_batch", max_batch), ("max_queue", max_queue),
                        ("max_body_bytes", max_body_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty: pass a key, or None to serve without one")
    if api_key is not None and keys is not None:
        raise ValueError("serve one API key or a keys file of tenants, not both")
    finder = ChunkFinder(registry if registry is not None else ChunkRegistry.for_engine(engine))
    scheduler = BatchScheduler(engine, max_batch=max_batch)
    metrics = Metrics(queue_depth=lambda: service.waiting, batch_size=lambda: scheduler.in_flight,
                      decode_steps=lambda: scheduler.steps, decode_rows=lambda: scheduler.rows,
                      indexed_chunks=lambda: service.indexed)
    service = Service(engine, finder, scheduler, metrics,
                      model_name=model_name or engine.loaded.name,
                      default_max_tokens=default_max_tokens, mode=mode, max_queue=max_queue,
                      tenants=keys is not None)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(scheduler.close, 60)  # answers under way end first
        service.close()

    app = FastAPI(title="TurboRAG", summary="OpenAI-compatible completions that reuse chunk KV "
                  "caches", lifespan=lifespan)
    app.state.service = service
    app.state.scheduler = scheduler
    # Outermost last: count every request, then check its key, then its size.
    app.add_middleware(LimitBody, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if api_key is not None or keys is not None:
        app.add_middleware(Authenticate, api_key=api_key, keys=keys)
    app.add_middleware(CountRequests, metrics=metrics, endpoints=ENDPOINTS,
                       tenants=keys is not None)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=str(exc.status_code), headers=exc.headers).response()

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
        if keys is not None:  # open to anyone: nothing that moves with a tenant's use
            return {"status": "ok"}
        return {"status": "ok", "model": service.model_name, "mode": service.mode,
                "queue_depth": service.waiting, "max_queue": service.max_queue,
                "in_flight": scheduler.in_flight, "max_batch": scheduler.max_batch,
                "indexed_chunks": service.indexed}

    @app.get("/metrics")
    async def prometheus_metrics():
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE)

    return app


def serve(*, model: str | None = None, store: str | Path | None = None,
          host: str = "127.0.0.1", port: int = 8000, encoder: str | None = "default",
          mode: str = "turbo", recovery: str = DEFAULT_RECOVERY, max_batch: int = MAX_BATCH,
          max_queue: int = MAX_QUEUE,
          max_body_bytes: int = MAX_BODY_BYTES, api_key: str | None = None,
          keys: str | Path | None = None, threads: int | None = None,
          question_last: bool = False, context_tokens: int | None = None,
          prompts: Sequence[Template] = (), device: str = "cpu",
          dtype: str = "float32") -> None:
    """Load the engine, warm it up, and serve it with uvicorn until interrupted.

    The model is loaded on a thread that ends, and warmed up on the scheduler's: from then on
    the scheduler's thread is the only one that runs torch (the event loop's never does).
    `threads` caps torch's threads (default: torch's own, one per core). Workers that share a
    machine should split its cores: two workers with a thread per core each keep twice as many
    OpenMP threads busy as there are cores, and every operation then waits for threads the other
    process has taken (measured: 5.8x fewer requests/s; docs/serving.md). `prompts`: the
    clients' prompt templates (core/prompt_template.py), whose heads get lead blobs.
    `device`, `dtype`: where the model runs and in what (core/models.py parse_device).
    """
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        torch.set_num_threads(threads)  # before any thread that runs torch starts
    log.info("torch threads: %d", torch.get_num_threads())
    key_file = KeyFile(keys) if keys is not None else None  # a missing file fails before loading
    engine_options = {} if context_tokens is None else {"context_tokens": context_tokens}
    engine = on_own_thread(lambda: TurboRAGEngine(model, store=store,
                                                   encoder=encoder, recovery=recovery,
                                                   question_last=question_last,
                                                   device=device, dtype=dtype,
                                                   **engine_options))
    with engine:
        for template in prompts:  # a template the engine cannot take fails before serving
            head = engine.add_prompt(render_prompt_template(template, engine.render_chat))
            log.info("lead blobs after a prompt head of %d characters", len(head))
        app = create_app(engine, mode=mode, max_batch=max_batch, max_queue=max_queue,
                         max_body_bytes=max_body_bytes, api_key=api_key, keys=key_file)
        app.state.scheduler.call(engine.warmup).result()
        uvicorn.run(app, host=host, port=port, log_level="info")
