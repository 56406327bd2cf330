"""The FastAPI app: OpenAI's completion endpoints over a TurboRAGEngine, plus chunk ingestion,
health and metrics.

    app = create_app(engine, max_batch=8)  # or: turborag serve --model ... --kv-store ...
                                           # (settings: ServerConfig, server/config.py)

    POST /v1/chat/completions, /v1/completions    OpenAI's bodies; "stream": true for SSE;
                                                  "turborag_rapid": true for RAPID (rapid.py)
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
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..core.batching import BatchScheduler, on_own_thread
from ..core.engine import TurboRAGEngine
from ..core.prompt_template import Template, render_prompt_template
from ..core.registry import ChunkRegistry
from ..core.config import EngineConfig
from ..core.rapid import RapidEngine
from ..core.settings import with_fields
from .config import NO_RAPID_FOR_TENANTS, ServerConfig
from .finder import ChunkFinder
from .guards import Authenticate, LimitBody
from .metrics import CONTENT_TYPE, CountRequests, Metrics
from .rapid import NO_DRAFTER, RapidAnswers, load_rapid
from .responses import APIError, Reply
from .schemas import ChatCompletionRequest, ChunksRequest, CompletionRequest
from .service import Service
from ..core.prompt_template import render_chat

log = logging.getLogger(__name__)

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


def create_app(engine: TurboRAGEngine, *, config: ServerConfig | None = None,
               registry: ChunkRegistry | None = None, rapid: RapidEngine | None = None,
               **settings) -> FastAPI:
    """The server over `engine`.

    config: a ServerConfig (server/config.py: the model name clients send, the default mode,
    batch and queue sizes, body limits, the API key or the tenants' keys file, a RAPID
    drafter to load); `settings` are its fields by name, applied on top of it. registry: where
    adapters in this process record chunk texts, followed by the server's lookup (default: the
    engine's own, `ChunkRegistry.for_engine`). rapid: answer RAPID requests with this
    RapidEngine over `engine` (instead of `rapid_drafter`, for settings of one's own:
    `RapidEngine(engine, drafter, gamma=4)`); the app closes only a drafter it loaded.

    The app's `BatchScheduler` (`app.state.scheduler`) owns the model from now on and stops
    when the app shuts down: run nothing else on the engine meanwhile (`scheduler.call` runs a
    function on its thread), and serve an engine from one app.
    """
    config = with_fields(config or ServerConfig(), "server", **settings)
    keys = config.keys
    rapid, loaded_drafter = _rapid_engine(engine, config, rapid)
    finder = ChunkFinder(registry if registry is not None else ChunkRegistry.for_engine(engine))
    scheduler = BatchScheduler(engine, max_batch=config.max_batch)
    metrics = Metrics(queue_depth=lambda: service.waiting, batch_size=lambda: scheduler.in_flight,
                      decode_steps=lambda: scheduler.steps, decode_rows=lambda: scheduler.rows,
                      indexed_chunks=lambda: service.indexed, admission=engine.admission,
                      tenants=keys is not None)
    service = Service(engine, finder, scheduler, metrics, config)
    answers = RapidAnswers(rapid, service) if rapid is not None else None
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(scheduler.close, 60)  # answers under way end first
        service.close()
        if loaded_drafter is not None:
            loaded_drafter.close()

    app = FastAPI(title="TurboRAG", summary="OpenAI-compatible completions that reuse chunk KV "
                  "caches", lifespan=lifespan)
    app.state.service = service
    app.state.scheduler = scheduler
    app.state.rapid = rapid
    # Outermost last: count every request, then check its key, then its size.
    app.add_middleware(LimitBody, max_bytes=config.max_body_bytes,
                       timeout_s=config.body_timeout_s)
    if config.api_key is not None or keys is not None:
        app.add_middleware(Authenticate, api_key=config.api_key, keys=keys)
    app.add_middleware(CountRequests, metrics=metrics, endpoints=ENDPOINTS)

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
        if req.turborag_rapid is not None and answers is None:
            raise APIError(400, NO_RAPID_FOR_TENANTS if keys is not None else NO_DRAFTER,
                           param="turborag_rapid", code="unsupported_parameter")
        try:
            prompt = render_chat(engine.tokenizer, req.chat())
        except Exception as exc:  # the model's template refuses some turn orders and roles
            raise APIError(400, f"the model's chat template refused these messages: {exc}",
                           param="messages") from None
        reply = Reply(chat=True, model=service.model_name)
        if req.turborag_rapid is not None:
            return await answers.complete(request, req, prompt, reply)
        return await service.complete(request, req, prompt, reply)

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
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def _rapid_engine(engine: TurboRAGEngine, config: ServerConfig,
                  rapid: RapidEngine | None) -> tuple[RapidEngine | None, TurboRAGEngine | None]:
    """The app's RapidEngine (None: no RAPID), and the drafter it loaded for it, if any (the
    app closes that one)."""
    if rapid is not None and config.rapid_drafter is not None:
        raise ValueError("give a RapidEngine (rapid=) or a drafter to load (rapid_drafter), "
                         "not both")
    if rapid is not None and rapid.target is not engine:
        raise ValueError("rapid= must be a RapidEngine whose target is the served engine")
    if rapid is not None and config.keys is not None:
        raise ValueError(NO_RAPID_FOR_TENANTS)
    if config.rapid_drafter is None:
        return rapid, None
    rapid = on_own_thread(lambda: load_rapid(engine, config.rapid_drafter))
    return rapid, (rapid.drafter if rapid.drafter is not engine else None)


def serve(model: str | None = None, *, store: str | Path | None = None,
          config: EngineConfig | None = None, server: ServerConfig | None = None,
          prompts: Sequence[Template] = (), host: str = "127.0.0.1", port: int = 8000,
          threads: int | None = None) -> None:
    """Load the engine, warm it up, and serve it with uvicorn until interrupted.

    The model is loaded on a thread that ends, and warmed up on the scheduler's: from then on
    the scheduler's thread is the only one that runs torch (the event loop's never does).
    `threads` caps torch's threads (default: torch's own, one per core). Workers that share a
    machine should split its cores: two workers with a thread per core each keep twice as many
    OpenMP threads busy as there are cores, and every operation then waits for threads the other
    process has taken (measured: 5.8x fewer requests/s; docs/serving.md). `prompts`: the
    clients' prompt templates (core/prompt_template.py), whose heads get lead blobs.
    config: the engine's (core/config.py: device, dtype, encoding, recovery); server: the
    app's (server/config.py). A RAPID drafter it names (`rapid_drafter`) loads as the model
    did, and is warmed up too, before serving: one that fails to load fails here.
    """
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        torch.set_num_threads(threads)  # before any thread that runs torch starts
    log.info("torch threads: %d", torch.get_num_threads())
    engine = on_own_thread(lambda: TurboRAGEngine(model, store=store, config=config))
    with engine:
        for template in prompts:  # a template the engine cannot take fails before serving
            head = engine.add_prompt(render_prompt_template(template, engine.tokenizer))
            log.info("lead blobs after a prompt head of %d characters", len(head))
        app = create_app(engine, config=server)  # loads the RAPID drafter, if one is named
        app.state.scheduler.call(engine.warmup).result()
        rapid = app.state.rapid
        if rapid is not None and rapid.drafter is not engine:
            app.state.scheduler.call(rapid.drafter.warmup).result()
        uvicorn.run(app, host=host, port=port, log_level="info")
