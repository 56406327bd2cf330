"""What the endpoints do with the engine: answer a prompt (whole or streamed), ingest chunks.

Every engine call runs as a job on the worker (worker.py), one at a time. A request waits for its
job's first event before it answers, so that an error while prefilling (a prompt too long for
the context window) is still an HTTP error and not a broken stream; while it waits it checks
that its client is still there, so a client that leaves while queued costs no prefill.
"""

from __future__ import annotations

import logging
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from ..core.engine import TurboRAGEngine
from ..core.settings import GenerationConfig
from .finder import ChunkFinder
from .metrics import Metrics
from .responses import APIError, EventStream, Reply, sse
from .schemas import ChunksRequest, CompletionParams
from .worker import Event, Job, Worker

log = logging.getLogger("turborag.server")

# The status a request gets counted with when its client left before the answer (nginx's).
CLIENT_GONE = 499
OPENAI_DEFAULT_TEMPERATURE = 1.0


class Service:
    def __init__(self, engine: TurboRAGEngine, finder: ChunkFinder, worker: Worker,
                 metrics: Metrics, *, model_name: str, default_max_tokens: int | None = None):
        """default_max_tokens: the limit of a chat completion that sets none; None lets it run
        to the end of the context window, as OpenAI's chat models do."""
        self.engine = engine
        self.finder = finder
        self.worker = worker
        self.metrics = metrics
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens

    # ---- completions ---------------------------------------------------------------------
    def check(self, req: CompletionParams) -> None:
        """Raise APIError for a request this server cannot answer as asked."""
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist here: this server runs "
                           f"{self.model_name!r}", param="model", code="model_not_found")
        refusal = req.refusal()
        if refusal is not None:
            param, message = refusal
            raise APIError(400, message, param=param, code="unsupported_parameter")

    def generation_config(self, req: CompletionParams) -> GenerationConfig:
        limit = req.token_limit or self.default_max_tokens or self.engine.context_window
        try:
            return GenerationConfig(
                max_new_tokens=limit,
                temperature=(req.temperature if req.temperature is not None
                             else OPENAI_DEFAULT_TEMPERATURE),
                top_p=req.top_p if req.top_p is not None else 1.0, seed=req.seed,
                stop=req.stop or ())
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    async def complete(self, request: Request, req: CompletionParams, prompt: str,
                       reply: Reply) -> Response:
        """Answer `prompt`: a JSON body, or server-sent events when `req.stream`."""
        config = self.generation_config(req)
        named = list(dict.fromkeys(req.turborag_chunks or ()))
        job = self.worker.submit(lambda job: self._generate(job, prompt, named, config, reply.id))
        event = await job.next(request)
        if event is None:
            return Response(status_code=CLIENT_GONE)
        if event[0] == "error":
            return APIError.of(event[1]).response()
        if req.stream:
            return EventStream(self._events(event, job, reply, req.include_usage), job)
        while event[0] == "delta":  # the result holds the whole text
            event = await job.next(request)
            if event is None:
                return Response(status_code=CLIENT_GONE)
        if event[0] == "error":
            return APIError.of(event[1]).response()
        return JSONResponse(reply.body(event[1]))

    async def _events(self, event: Event, job: Job, reply: Reply,
                      include_usage: bool) -> AsyncIterator[str]:
        for chunk in reply.opening():
            yield sse(chunk)
        while event[0] == "delta":
            yield sse(reply.chunk(event[1]))
            event = await job.next()
        if event[0] == "error":  # after the first token: the stream reports it and ends
            yield sse(APIError.of(event[1]).body)
            return
        for chunk in reply.closing(event[1], include_usage=include_usage):
            yield sse(chunk)
        yield sse("[DONE]")

    def _generate(self, job: Job, prompt: str, named: list[str], config: GenerationConfig,
                  label: str) -> None:
        """On the worker thread: find the chunks, generate, post deltas; stop if cancelled."""
        if named:
            self.engine.prepare_chunks(named, warm=False)  # encode those with no blob yet
            self.finder.add(named)
        started = time.perf_counter()
        chunks = list(dict.fromkeys([*self.finder.find(prompt), *named]))
        lookup_s = time.perf_counter() - started
        stream = self.engine.stream(prompt, chunks=chunks, config=config)
        try:
            for delta in stream:
                if job.cancelled.is_set():
                    break
                job.post("delta", delta)
        finally:
            stream.close()  # no-op once it has run to its end; else stops decoding now
            result = stream.result
            if result is not None:  # None: the prefill failed (the error is posted)
                result.stats.extra["chunk_lookup_s"] = lookup_s
                self.metrics.generation(result.stats)
                log.info("%s: %s after %d tokens (%d of %d prompt tokens reused)", label,
                         result.stats.finish_reason, result.stats.new_tokens,
                         result.stats.reused_tokens, result.stats.prompt_tokens)
        job.post("done", result)

    # ---- ingestion -----------------------------------------------------------------------
    async def ingest(self, request: Request, req: ChunksRequest) -> Response:
        """Encode and store the blobs of chunk texts, and index the texts for lookup."""
        if any(not text.strip() for text in req.texts):
            raise APIError(400, "every text must hold more than white space", param="texts")

        def encode(job: Job) -> None:
            doc_ids = [req.doc_id] * len(req.texts) if req.doc_id else None
            keys = self.engine.encode_chunks(req.texts, doc_ids=doc_ids)
            job.post("done", {"keys": keys, "indexed": self.finder.add(req.texts)})

        event = await self.worker.submit(encode).next(request)
        if event is None:
            return Response(status_code=CLIENT_GONE)
        if event[0] == "error":
            return APIError.of(event[1]).response()
        done = event[1]
        return JSONResponse({"object": "list", "keys": done["keys"], "indexed": done["indexed"],
                             "total_indexed": len(self.finder)})
