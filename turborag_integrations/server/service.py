"""What the endpoints do with the engine: answer a prompt (whole or streamed), ingest chunks.

All work on the model runs on the batch scheduler's thread (core/batching.py): answers are
submitted to the scheduler and decoded together with the others in flight; finding a prompt's
chunks, encoding the chunks a request names, and ingestion run there as calls between two
decoding rounds. Each request waits for its work as a job on a thread of its own (jobs.py).

A request waits for its first event before it answers, so that an error while prefilling (a
prompt too long for the context window) is still an HTTP error and not a broken stream; while it
waits it checks that its client is still there, so a client that leaves while queued costs no
prefill. At most `max_queue` requests wait so (from their arrival to their first token, or to the
end of an ingestion); the next is refused with a 429 and a Retry-After header.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import AsyncIterator, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from ..core.batching import BatchScheduler, RequestCancelled
from ..core.engine import TurboRAGEngine
from ..core.settings import GenerationConfig
from ..core.store.namespaces import PUBLIC, namespace_of, readable
from .finder import ChunkFinder
from .jobs import Event, Job
from .keys import Principal
from .metrics import Metrics
from .responses import APIError, EventStream, Reply, clip, sse
from .schemas import ChunksRequest, CompletionParams

log = logging.getLogger("turborag.server")

# The status a request gets counted with when its client left before the answer (nginx's).
CLIENT_GONE = 499
OPENAI_DEFAULT_TEMPERATURE = 1.0
RETRY_AFTER_S = 1  # what a refused request is told to wait: a place frees up per finished answer
NOBODY = Principal("")  # the caller on a server without keys


def request_namespace(principal: Principal, salt: str | None, public: bool = False) -> str:
    """Where a request's blobs lie: its tenant's namespace, split by its cache salt; or the
    public one, which every tenant's prompts also reuse."""
    return PUBLIC if public else namespace_of(principal.tenant, salt)


class Service:
    def __init__(self, engine: TurboRAGEngine, finder: ChunkFinder, scheduler: BatchScheduler,
                 metrics: Metrics, *, model_name: str, default_max_tokens: int | None = None,
                 mode: str = "turbo", max_queue: int = 64, tenants: bool = False):
        """default_max_tokens: the limit of a chat completion that sets none; None lets it run
        to the end of the context window, as OpenAI's chat models do. mode: "turbo" (reuse the
        chunks' blobs) or "naive" (prefill every prompt whole: the baseline to compare with),
        for requests that do not set `turborag_mode`. max_queue: how many requests may wait.
        tenants: requests carry a tenant (a keys file): the metrics count per tenant too.

        Each request works in its namespace (`request_namespace`): its tenant's, split by its cache
        salt. The texts found in its prompt are looked up there, in its tenant's when it has a
        salt, and in the public namespace (`namespaces.readable`), nowhere else; its blobs come
        from those namespaces' stores, and what it encodes goes into its own."""
        self.engine = engine
        self.finders = {"": finder}  # the default namespace's follows in-process adapters
        self.tenants = tenants
        self.scheduler = scheduler
        self.metrics = metrics
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.mode = mode
        self.max_queue = max_queue
        self.waiting = 0  # requests waiting for the model (touched on the event loop only)

    @contextmanager
    def _queued(self) -> Iterator[None]:
        """A place among the requests waiting for the model, or a 429 when they are full."""
        if self.waiting >= self.max_queue:
            raise APIError(429, f"the server is busy: {self.waiting} requests are waiting for the "
                           f"model already (at most {self.max_queue}); retry in {RETRY_AFTER_S} s",
                           type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1

    # ---- completions ---------------------------------------------------------------------
    def check(self, req: CompletionParams) -> None:
        """Raise APIError for a request this server cannot answer as asked."""
        if req.model != self.model_name:
            raise APIError(404, f"the model {clip(req.model)!r} does not exist here: this server "
                           f"runs {self.model_name!r}", param="model", code="model_not_found")
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
                stop=req.stop or (), ignore_eos=req.ignore_eos)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    @property
    def indexed(self) -> int:
        """Chunk texts indexed over every namespace."""
        return sum(len(f) for f in list(self.finders.values()))

    def finder(self, namespace: str) -> ChunkFinder:
        """The index of a namespace's chunk texts (made on first use: by an ingestion, or by
        a request that names chunks)."""
        found = self.finders.get(namespace)
        if found is None:
            found = self.finders.setdefault(namespace, ChunkFinder())
        return found

    def view(self, namespace: str) -> TurboRAGEngine:
        """The engine in `namespace`, reading the chunks of the namespaces `readable` names too:
        a salted request's tenant's, and the public one."""
        return self.engine.namespaced(namespace, shared=readable(namespace)[1:])

    async def complete(self, request: Request, req: CompletionParams, prompt: str,
                       reply: Reply) -> Response:
        """Answer `prompt`: a JSON body, or server-sent events when `req.stream`."""
        config = self.generation_config(req)
        mode = req.turborag_mode or self.mode
        named = list(dict.fromkeys(req.turborag_chunks or ())) if mode == "turbo" else []
        principal = principal_of(request)
        namespace = request_namespace(principal, req.cache_salt)
        with self._queued():
            job = Job(lambda job: self._generate(job, prompt, named, config, mode, reply.id,
                                                 namespace, principal))
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
                  mode: str, label: str, namespace: str, principal: Principal) -> None:
        """On the job's thread: find the chunks, then post the answer's deltas as the scheduler
        decodes them; stop when the job is cancelled."""
        chunks, lookup_s = [], 0.0
        view = self.view(namespace)
        if mode == "turbo":
            chunks, lookup_s = self.scheduler.call(
                lambda: self._chunks_in(prompt, named, view)).result()
        if job.cancelled.is_set():  # the client left during the lookup
            return
        stream = self.scheduler.submit(prompt, chunks=chunks, config=config, mode=mode,
                                       cancelled=job.cancelled, engine=view)
        try:
            for delta in stream:
                if job.cancelled.is_set():
                    break
                job.post("delta", delta)
        except RequestCancelled:  # the client left while the request waited for its turn
            return
        finally:
            stream.close()  # no-op once it has run to its end; else it leaves the batch now
            result = stream.result
            if result is not None:  # None: the prefill failed (the error is posted)
                if job.cancelled.is_set():  # the scheduler may have ended it first
                    result.stats.finish_reason = "cancelled"
                result.stats.extra["chunk_lookup_s"] = lookup_s
                self.metrics.generation(result.stats,
                                        tenant=principal.tenant if self.tenants else None)
                log.info("%s: %s after %d tokens (%d of %d prompt tokens reused)", label,
                         result.stats.finish_reason, result.stats.new_tokens,
                         result.stats.reused_tokens, result.stats.prompt_tokens)
        job.post("done", result)

    def _chunks_in(self, prompt: str, named: list[str],
                   view: TurboRAGEngine) -> tuple[list[str], float]:
        """On the scheduler's thread: encode the named chunks that have no blob yet (in the
        request's namespace), then the chunks to reuse (those of its namespace and the public
        one found in the prompt, and the named ones) and the lookup's time."""
        if named:
            view.prepare_chunks(named, warm=False)
            self.finder(view.namespace).add(named)
        started = time.perf_counter()
        found = []
        for namespace in readable(view.namespace):
            finder = self.finders.get(namespace)
            if finder is not None:
                found += finder.find(prompt)
        return list(dict.fromkeys([*found, *named])), time.perf_counter() - started

    # ---- ingestion -----------------------------------------------------------------------
    async def ingest(self, request: Request, req: ChunksRequest) -> Response:
        """Encode and store the blobs of chunk texts, and index the texts for lookup."""
        if any(not text.strip() for text in req.texts):
            raise APIError(400, "every text must hold more than white space", param="texts")

        namespace = request_namespace(principal_of(request), req.cache_salt, req.public)
        view, finder = self.engine.namespaced(namespace), self.finder(namespace)

        def encode(job: Job) -> None:
            # One encoder batch per call: the requests in flight decode between two batches.
            step = self.engine.encoder.batch_size
            keys, indexed = [], 0
            for start in range(0, len(req.texts), step):
                if job.cancelled.is_set():
                    return
                texts = req.texts[start:start + step]
                doc_ids = [req.doc_id] * len(texts) if req.doc_id else None
                done = self.scheduler.call(lambda texts=texts, doc_ids=doc_ids: (
                    view.encode_chunks(texts, doc_ids=doc_ids), finder.add(texts)))
                part, added = done.result()
                keys += part
                indexed += added
            job.post("done", {"keys": keys, "indexed": indexed})

        with self._queued():
            event = await Job(encode).next(request)
        if event is None:
            return Response(status_code=CLIENT_GONE)
        if event[0] == "error":
            return APIError.of(event[1]).response()
        done = event[1]
        return JSONResponse({"object": "list", "keys": done["keys"], "indexed": done["indexed"],
                             "total_indexed": len(finder)})


def principal_of(request: Request) -> Principal:
    """The caller the authentication middleware recognised (guards.Authenticate)."""
    return request.scope.get("state", {}).get("principal", NOBODY)
