"""What the endpoints do with the engine: answer a prompt (whole or streamed), ingest chunks.

A request's life runs on the event loop, with no thread of its own:

1. its chunks are found in its prompt (finder.py) on a small pool of lookup threads: text work,
   kept off the event loop (milliseconds for a long prompt) and off the model's thread; chunks
   the request names are encoded first, on the model's thread (`scheduler.call`);
2. it is added to the batch scheduler under its id (the answer's id, `chatcmpl-…`), whose
   worker thread, the only one that runs the model, decodes it with the others in flight and
   reports its token ids;
3. the output loop (outputs.py) turns those ids into its text on the event loop, and the
   handler answers from its queue of events.

A request waits for its first event before it answers, so that an error while prefilling (a
prompt too long for the context window) is still an HTTP error and not a broken stream. A client
that leaves is noticed as it leaves (disconnect.py) and its request aborted by id: one still
queued costs no prefill, one in the batch frees its place at the next round. At most
`max_queue` requests wait (from their arrival to their first token, or to the end of an
ingestion); the next is refused with a 429 and a Retry-After header. Ingestion encodes one
encoder batch per call on the model's thread, and indexes it on a lookup thread. A RAPID answer
(rapid.py) is answered the same way from its submission on (`answer`), its generation stepped
on the model's thread through `scheduler.call` instead of joining the batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import AsyncIterator, Awaitable, Callable, Iterator

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from ..core.batching import BatchScheduler
from ..core.engine import TurboRAGEngine
from ..core.request import Request as Generation
from ..core.run import GenerationResult
from ..core.settings import GenerationConfig
from ..core.store.namespaces import PUBLIC, namespace_of, readable
from .config import ServerConfig
from .disconnect import ClientGone, Disconnection
from .finder import ChunkFinder
from .keys import Principal
from .metrics import Metrics
from .outputs import Event, Events, OutputLoop
from .responses import APIError, EventStream, Reply, clip, event_data
from .schemas import ChunksRequest, CompletionParams

log = logging.getLogger("turborag.server")

# The status a request gets counted with when its client left before the answer (nginx's).
CLIENT_GONE = 499
OPENAI_DEFAULT_TEMPERATURE = 1.0
RETRY_AFTER_S = 1  # what a refused request is told to wait: a place frees up per finished answer
NOBODY = Principal("")  # the caller on a server without keys
# Threads that find chunks in prompts and index chunk texts: a lookup takes milliseconds under
# the GIL, so more threads would only queue for it.
LOOKUP_THREADS = 2
# What starts a generation for `Service.answer`: its events, and how to abort it.
Submit = Callable[[Disconnection], Awaitable[tuple[Events, Callable[[], None]]]]


def request_namespace(principal: Principal, salt: str | None, public: bool = False) -> str:
    """Where a request's blobs lie: its tenant's namespace, split by its cache salt; or the
    public one, which every tenant's prompts also reuse."""
    return PUBLIC if public else namespace_of(principal.tenant, salt)


class Service:
    def __init__(self, engine: TurboRAGEngine, finder: ChunkFinder, scheduler: BatchScheduler,
                 metrics: Metrics, config: ServerConfig):
        """config: the server's (server/config.py) — the model name clients send, the limit of
        a completion that sets none (None lets it run to the end of the context window, as
        OpenAI's chat models do), the mode of requests that set no `turborag_mode`, how many
        requests may wait, and whether requests carry a tenant (a keys file: the metrics count
        per tenant too).

        Each request works in its namespace (`request_namespace`): its tenant's, split by its cache
        salt. The texts found in its prompt are looked up there, in its tenant's when it has a
        salt, and in the public namespace (`namespaces.readable`), nowhere else; its blobs come
        from those namespaces' stores, and what it encodes goes into its own."""
        self.engine = engine
        self.finders = {"": finder}  # the default namespace's follows in-process adapters
        self.tenants = config.tenants
        self.scheduler = scheduler
        self.metrics = metrics
        self.model_name = config.model_name or engine.loaded.name
        self.default_max_tokens = config.default_max_tokens
        self.mode = config.mode
        self.max_queue = config.max_queue
        self.waiting = 0  # requests waiting for the model (touched on the event loop only)
        self.outputs = OutputLoop(scheduler)
        self.lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="turborag-lookup")

    def close(self) -> None:
        """Let the lookup threads go (once the scheduler has stopped)."""
        self.lookups.shutdown(wait=False, cancel_futures=True)

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
            return GenerationConfig.from_options(
                {"temperature": OPENAI_DEFAULT_TEMPERATURE},  # OpenAI's, not greedy
                {"max_tokens": limit, "temperature": req.temperature, "top_p": req.top_p,
                 "seed": req.seed, "stop": req.stop, "ignore_eos": req.ignore_eos})
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
        view = self.view(namespace)

        async def submit(client: Disconnection) -> tuple[Events, Callable[[], None]]:
            chunks, lookup_s = ((await client.wait(self._chunks_in(prompt, named, view)))
                                if mode == "turbo" else ([], 0.0))
            # the request whole, as the scheduler answers it: its tenant travels in it
            generation = Generation(prompt, tuple(chunks), config, mode,
                                    recovery=req.turborag_recovery, namespace=namespace,
                                    shared=readable(namespace)[1:])
            stream = self.outputs.add(
                reply.id, generation,
                on_end=lambda result: self._ended(result, reply.id, lookup_s, principal))
            return stream, lambda: self.outputs.abort(reply.id)

        return await self.answer(request, req, reply, submit)

    async def answer(self, request: Request, req: CompletionParams, reply: Reply,
                     submit: Submit) -> Response:
        """Answer the generation `submit(client)` starts: a JSON body, or server-sent events
        when `req.stream`. `submit` returns the generation's events (`Events`) and how to
        abort it; it runs with a place among the waiting requests, kept until the first event,
        and may raise ClientGone (`client.wait`) when the client leaves before it submits."""
        with Disconnection(request) as client:
            with self._queued():
                try:
                    stream, abort = await submit(client)
                except ClientGone:  # it left before its generation was submitted
                    return Response(status_code=CLIENT_GONE)
                except Exception as exc:
                    return APIError.of(exc).response()
                client.on_gone(abort)
                event = await stream.next()
            if event is None:
                return Response(status_code=CLIENT_GONE)
            if event[0] == "error":
                return APIError.of(event[1]).response()
            if req.stream:  # the response watches the connection from here (disconnect.py)
                return EventStream(self._events(event, stream, reply, req.include_usage),
                                   on_close=abort)
            while event[0] == "delta":  # the result holds the whole text
                event = await stream.next()
                if event is None:
                    return Response(status_code=CLIENT_GONE)
        if event[0] == "error":
            return APIError.of(event[1]).response()
        return JSONResponse(reply.body(event[1]))

    async def _events(self, event: Event, stream: Events, reply: Reply,
                      include_usage: bool) -> AsyncIterator[str]:
        for chunk in reply.opening():
            yield event_data(chunk)
        while event[0] == "delta":
            yield event_data(reply.chunk(event[1]))
            event = await stream.next()
            if event is None:  # aborted: its client has gone
                return
        if event[0] == "error":  # after the first token: the stream reports it and ends
            yield event_data(APIError.of(event[1]).body)
            return
        for chunk in reply.closing(event[1], include_usage=include_usage):
            yield event_data(chunk)
        yield event_data("[DONE]")

    def _ended(self, result: GenerationResult, label: str, lookup_s: float,
               principal: Principal) -> None:
        """A generation has ended, however: count it, and log it."""
        result.stats.extra["chunk_lookup_s"] = lookup_s
        self.metrics.generation(result.stats, tenant=principal.tenant if self.tenants else None)
        log.info("%s: %s after %d tokens (%d of %d prompt tokens reused)", label,
                 result.stats.finish_reason, result.stats.new_tokens,
                 result.stats.reused_tokens, result.stats.prompt_tokens)

    async def _chunks_in(self, prompt: str, named: list[str],
                         view: TurboRAGEngine) -> tuple[list[str], float]:
        """The chunks to reuse (those of the request's namespace and the public one found in
        the prompt, and the named ones) and the lookup's time. Named chunks that have no blob
        yet are encoded first, in the request's namespace, on the model's thread (under a hot
        set, later, by its background encoder)."""
        if named and view.encodes_at_ingestion:  # else the hot set's (core/admission.py)
            await asyncio.wrap_future(
                self.scheduler.call(lambda: view.library.prepare_chunks(named, warm=False)))
        return await asyncio.get_running_loop().run_in_executor(
            self.lookups, self._find, prompt, named, view.namespace)

    def _find(self, prompt: str, named: list[str], namespace: str) -> tuple[list[str], float]:
        """On a lookup thread: index the named chunks, then find the known ones in `prompt`."""
        if named:
            self.finder(namespace).add(named)
        started = time.perf_counter()
        found = []
        for readable_namespace in readable(namespace):
            finder = self.finders.get(readable_namespace)
            if finder is not None:
                found += finder.find(prompt)
        return list(dict.fromkeys([*found, *named])), time.perf_counter() - started

    # ---- ingestion -----------------------------------------------------------------------
    async def ingest(self, request: Request, req: ChunksRequest) -> Response:
        """Encode and store the blobs of chunk texts, and index the texts for lookup."""
        if any(not text.strip() for text in req.texts):
            raise APIError(400, "every text must hold more than white space", param="texts")
        if req.contexts is not None and len(req.contexts) != len(req.texts):
            raise APIError(400, f"{len(req.contexts)} contexts for {len(req.texts)} texts: give "
                           "one per text (null for a document's first piece)", param="contexts")

        namespace = request_namespace(principal_of(request), req.cache_salt, req.public)
        view, finder = self.engine.namespaced(namespace), self.finder(namespace)
        step = self.engine.library.encoder.batch_size
        keys, indexed = [], 0
        with Disconnection(request) as client, self._queued():
            try:
                for start in range(0, len(req.texts), step):
                    texts = req.texts[start:start + step]
                    doc_ids = [req.doc_id] * len(texts) if req.doc_id else None
                    contexts = req.contexts[start:start + step] if req.contexts else None
                    part, added = await client.wait(
                        self._encode(view, finder, texts, doc_ids, contexts))
                    keys += part
                    indexed += added
            except ClientGone:  # the batch under way is still encoded and indexed
                return Response(status_code=CLIENT_GONE)
            except Exception as exc:
                return APIError.of(exc).response()
        return JSONResponse({"object": "list", "keys": keys, "indexed": indexed,
                             "total_indexed": len(finder)})

    async def _encode(self, view: TurboRAGEngine, finder: ChunkFinder, texts: list[str],
                      doc_ids: list[str] | None,
                      contexts: list[str | None] | None = None) -> tuple[list[str], int]:
        """Encode one encoder batch on the model's thread (the requests in flight decode between
        two batches), then index it on a lookup thread."""
        if view.encodes_at_ingestion:
            keys = await asyncio.wrap_future(self.scheduler.call(
                lambda: view.encode_chunks(texts, doc_ids=doc_ids, contexts=contexts)))
        else:  # a hot set: blobs come on a chunk's k-th retrieval (core/admission.py)
            keys = [None] * len(texts)
        added = await asyncio.get_running_loop().run_in_executor(self.lookups, finder.add, texts)
        return keys, added


def principal_of(request: Request) -> Principal:
    """The caller the authentication middleware recognised (guards.Authenticate)."""
    return request.scope.get("state", {}).get("principal", NOBODY)
