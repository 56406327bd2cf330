"""Continuous batching: many streamed generations decoded together on one engine.

A decode step of a small model on a CPU is bound by reading memory: all the weights, and the
request's KV cache. Requests decoded together in one batched step (core/decode/batch.py) share
the read of the weights; each still reads its own cache. `BatchScheduler` gives one engine's
model to a worker thread that decodes every request in flight in one batched step:

    scheduler = BatchScheduler(engine, max_batch=8)
    stream = scheduler.submit(prompt, chunks=chunks, config=GenerationConfig(max_new_tokens=64))
    for delta in stream: ...               # iterate streams on several threads: they decode together
    stream.result.stats.ttft_s

`submit` takes the arguments of `engine.stream` and returns the same `GenerationStream`, with the
same text deltas, stop strings, `.result` and stats, so a caller can switch between the two. As
with `engine.stream`, nothing happens until the stream is first iterated; its first `next()`
waits for the request's turn and prefill, so errors of the prefill are raised there.

Underneath, requests have ids, and the worker reports token ids, not text (vLLM's engine core
and output processor split so):

    scheduler.add_request("req-1", Request(prompt, chunks, config), on_output=callback)
    scheduler.abort("req-1")               # queued or running: it leaves at the next round

`callback` gets a `RequestOutput` (core/scheduled.py) on the worker's thread after each round
with its new token ids, and a last one, `finished`, once the worker holds nothing of it. It must
return at once: hand the output to another thread or an event loop (server/outputs.py does).
`submit` is built on these: its stream reads a queue of outputs and turns the ids into text.

The worker repeats (the rounds themselves are core/batch_worker.py's `BatchWorker`):
0. calls: run the functions given to `call(fn)` (other work on the model, such as encoding
   chunks or a warm-up, which belongs on this thread too; see the last paragraph), each with a
   `concurrent.futures.Future` of its result. While one runs, every request in flight waits, so
   split long work into several calls.
1. admit: while fewer than `max_batch` requests are in flight, take the next waiting request and
   prefill it alone (`engine.start`, the stitched prefill of `engine.stream`); its first token comes from the prefill's logits and is handed over at once.
   A failing prefill fails that request only. A batched request's cache is then copied into
   the next free row of the scheduler's `BatchArena` (core/kv/arena.py) and the prefill's
   cache goes back to the pool: the batch's caches are rows of one storage, attended in one
   call per layer.
2. step: one `BatchedDecoder.step` for every batched request in flight, then each request draws
   its next token with its own `Sampler` (its own temperature, top-k/top-p and seeded generator),
   so it gets the tokens it would get alone (greedy: equal to `engine.generate`, tested).
3. retire: a request leaves after its last token (max_new_tokens, the end of the context window
   or an end-of-sequence token), at the round after it is aborted (a stop string, a stream
   closed, a client that is gone) and on an error; its row of the arena (or the cache of an
   unbatched request, back to the engine's pool) is free before its last output is sent, so
   before a stream's close returns.

A request aborted while it waits is never prefilled: its last output carries `RequestCancelled`
(which its stream raises). A caller of `submit` may pass `cancelled=` (a `threading.Event`) and
set it to do the same without touching the stream, from any thread.

Requests a batched step does not serve decode on the same worker, one token per round alongside
the batch, through the engine's own decode loop: drafted decoding (`config.draft`: several
tokens per verification round), quantised decoding (`config.quantize`: the int8 path scales
activations over the whole input, so rows would change each other's answers), and every request
of a model the fast path does not support. They take a place in the batch like the others.

The worker should be the only thread that runs torch. Another thread calling the engine at the
same time gets correct answers but slows both down. So does, with the GNU OpenMP of PyTorch's
CPU builds, a thread that merely ran torch before and is still alive (the main thread that
loaded the model, typically): it keeps its own OpenMP thread pool, and once the pools hold more
threads than there are cores, OpenMP stops spinning between parallel regions and every operation
of the process pays for waking its threads (a decode step took ≈1.7x as long on a 2-core
machine). Load the model on a thread that ends before the scheduler starts (see
benchmarks/batching.py), and run the rest of the work on the model through `call`.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Iterable, Sequence, TypeVar

from .batch_worker import BatchWorker
from .decode.loop import now
from .engine import TurboRAGEngine
from .prefill.stitch import Segment
from .request import Request
from .run import GenerationStream, Run
from .scheduled import OutputQueue, RequestCancelled, RequestOutput, Scheduled
from .settings import GenerationConfig

__all__ = ["BatchScheduler", "RequestCancelled", "RequestOutput", "on_own_thread"]

STOPPED = "the batch scheduler's worker stopped"

class BatchScheduler:
    """Decodes the generations submitted to it together, on one worker thread that owns
    `engine`'s model; see the module docstring."""

    def __init__(self, engine: TurboRAGEngine, max_batch: int = 8, *,
                 name: str = "turborag-batch"):
        if max_batch < 1:
            raise ValueError("max_batch must be ≥ 1")
        self.engine = engine
        self.max_batch = max_batch
        # Up to max_batch caches are in use at once; keep that many in the pool, or every
        # admission pays for faulting in a fresh buffer (≈0.1 s at 4K tokens).
        engine.cache_pool.keep_at_least(max_batch)
        self._waiting: deque[Scheduled] = deque()
        self._requests: dict[str, Scheduled] = {}  # by id, until their last output (the lock's)
        self._stream_ids = itertools.count()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._worker = BatchWorker(engine, max_batch, self._forget)  # worker thread only
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    # ---- the callers' side -------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[Segment], *, chunks: Iterable[str] = (),
               config: GenerationConfig | None = None, mode: str = "turbo",
               encode_missing: bool = False, recovery=None,
               cancelled: threading.Event | None = None) -> GenerationStream:
        """A stream of `prompt`'s answer (arguments as `TurboRAGEngine.stream`); the request
        joins the batch when the stream is first iterated.

        cancelled: an event that withdraws the request once set (from any thread): never
        prefilled if it is still waiting (the stream raises `RequestCancelled`), out of the
        batch at the next round if it is in."""
        request = Request(prompt, tuple(chunks), config or GenerationConfig(), mode,
                          encode_missing, recovery)
        engine = self._engine_for(request)
        return GenerationStream(start=lambda: self._start(request, engine, cancelled))

    def add_request(self, request_id: str, request: Request, *,
                    on_output: Callable[[RequestOutput], None]) -> None:
        """Queue `request` under `request_id`; the worker reports it to `on_output` (module
        docstring) until a last, finished output. It is answered on the scheduler's engine in
        the request's namespace (`Request.namespace`). An id may be used again once its request
        has finished."""
        self._add(Scheduled(request_id, request, self._engine_for(request), on_output))

    def abort(self, request_id: str) -> bool:
        """Withdraw a request, from any thread: one still queued is never prefilled, one in the
        batch leaves it at the next round; either way its cache is freed and its last output
        (finished, "cancelled") follows. False for an id that is not queued or running (never
        added, or finished already)."""
        with self._cond:
            request = self._requests.get(request_id)
            if request is None:
                return False
            request.aborted = True
            self._cond.notify()
        return True

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn()` on the worker thread before the next round; the Future holds its result or
        its exception. For work on the model other than decoding (encoding chunks, a warm-up),
        which would slow the batch down on another thread (module docstring). Calls run in the
        order they came; a call cancelled through its Future before it starts does not run."""
        future: Future = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch scheduler is closed")
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    @property
    def in_flight(self) -> int:
        """Requests being decoded now (a snapshot). A request whose stream has ended is not
        counted, though the worker drops it from its list only at the end of the round."""
        return sum(not r.finished for r in self._worker.active)

    @property
    def steps(self) -> int:
        """Batched decode steps run so far."""
        return self._worker.steps

    @property
    def rows(self) -> int:
        """The sum of their batch sizes (rows / steps: the mean batch size)."""
        return self._worker.rows

    @property
    def waiting(self) -> int:
        """Requests waiting for a place in the batch (a snapshot)."""
        return len(self._waiting)

    def close(self, timeout: float | None = None) -> None:
        """Take no more requests or calls; those submitted already run to their end, then the
        worker stops (waits up to `timeout` seconds for that)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)

    def __enter__(self) -> "BatchScheduler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _engine_for(self, request: Request) -> TurboRAGEngine:
        """The view of the scheduler's engine a request is answered on: its namespace's (the
        engine itself for a request that names none)."""
        if request.namespace is None and not request.shared:
            return self.engine
        name = self.engine.namespace if request.namespace is None else request.namespace
        return self.engine.namespaced(name, shared=request.shared)

    def _add(self, request: Scheduled) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the batch scheduler is closed")
            if request.id in self._requests:
                raise ValueError(f"a request with the id {request.id!r} is queued or running")
            request.submitted = now()
            self._requests[request.id] = request
            self._waiting.append(request)
            self._cond.notify()

    def _start(self, request: Request, engine: TurboRAGEngine,
               cancelled: threading.Event | None) -> Run:
        """A submitted stream's first iteration: queue the request, wait for its prefill."""
        outputs = OutputQueue()
        scheduled = Scheduled(f"stream-{next(self._stream_ids)}", request, engine, outputs.put,
                              withdrawn=cancelled)
        self._add(scheduled)
        first = outputs.get()
        if first.error is not None:
            raise first.error

        def finish() -> None:
            self.abort(scheduled.id)  # a no-op once the worker has retired it
            # A stream dropped unclosed is finalised by the garbage collector, on any thread:
            # on the worker's, waiting would wait for itself; it retires the request next round.
            if threading.current_thread() is not self._thread:
                outputs.drain()  # its cache is free once its last output is sent

        return Run(outputs.tokens(first), scheduled.stats, scheduled.limit,
                   self.engine.tokenizer, request.config.stop, finish)

    # ---- the worker --------------------------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._rounds()
        finally:  # a worker that dies (a bug) still ends every request it was given
            with self._cond:
                self._closed = True
                left = list(self._requests.values())  # queued, in the batch, or being admitted
                calls = list(self._calls)
                self._waiting.clear()
                self._calls.clear()
            for request in left:
                self._worker.retire(request, "error", RuntimeError(STOPPED))
            for _, future in calls:
                if future.set_running_or_notify_cancel():
                    future.set_exception(RuntimeError(STOPPED))

    def _rounds(self) -> None:
        self._worker.prepare()
        while True:
            with self._cond:
                while (not self._waiting and not self._worker.active and not self._calls
                       and not self._closed):
                    self._cond.wait()
                if (self._closed and not self._waiting and not self._worker.active
                        and not self._calls):
                    return
                calls = list(self._calls)
                self._calls.clear()
                withdrawn = [r for r in self._waiting if r.dropped()]
                if withdrawn:
                    self._waiting = deque(r for r in self._waiting if not r.dropped())
                admit = []
                while self._waiting and len(self._worker.active) + len(admit) < self.max_batch:
                    admit.append(self._waiting.popleft())
            for fn, future in calls:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as exc:  # the caller's; the worker keeps serving
                        future.set_exception(exc)
            self._worker.round(withdrawn, admit)

    def _forget(self, request: Scheduled) -> None:
        with self._cond:
            self._requests.pop(request.id, None)


T = TypeVar("T")


def on_own_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread that ends when it returns, its result or its error: torch work done
    there (loading a model, encoding chunks) leaves no OpenMP thread pool behind to compete with
    the scheduler's worker (docs/batching.md#threads)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised on the calling thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="turborag-load")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
