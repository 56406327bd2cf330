"""What the batch scheduler's worker thread holds and does in each round (core/batching.py).

The scheduler keeps the queue, the calls and the callers' side; its worker hands every round
to a `BatchWorker`: the requests in flight, the batched decoder and the `BatchArena` whose rows
hold their caches. A round retires the requests withdrawn while they waited, admits new ones
(prefill, first token, a row of the arena), drops those aborted, and steps: one batched step
for every batched request, one token of its own decode loop for each of the others. A request
leaves after its last token, when aborted and on an error, its cache freed before its last
output is sent. Only the worker thread touches it.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from .decode.batch import BatchedDecoder
from .decode.loop import decode_loop, now
from .decode.sampling import Sampler
from .decode.start import DecodeStart
from .engine import TurboRAGEngine
from .kv.arena import BatchArena
from .scheduled import WITHDRAWN, RequestCancelled, RequestOutput, Scheduled

__all__ = ["BatchWorker"]

log = logging.getLogger("turborag_integrations.core.batching")


class BatchWorker:
    """The requests in flight on one engine and the rounds that decode them."""

    def __init__(self, engine: TurboRAGEngine, max_batch: int,
                 on_retired: Callable[[Scheduled], None]):
        self.engine = engine
        self.max_batch = max_batch
        self.active: list[Scheduled] = []
        self.steps = 0  # batched decode steps run so far
        self.rows = 0  # the sum of their batch sizes (rows / steps: the mean batch size)
        # The model's batched decoder, looked up at each admission (the lookup checks that the
        # fast path still supports the model, ≈2 ms for SmolLM2: too much for every step).
        self._decoder: BatchedDecoder | None = None
        # The batched requests' caches, rows of one storage (made at the first admission).
        self.arena: BatchArena | None = None
        self._on_retired = on_retired  # told before a request's last output is sent

    def prepare(self) -> None:
        """The batched decoder's one-time work (timing the products, packing the weights: ≈1 s
        for SmolLM2), before the first request rather than in its prefill's place."""
        try:
            with torch.inference_mode():
                BatchedDecoder.for_model(self.engine.model, rows=self.max_batch)
        except Exception:  # the first admission tries again and fails that request, if any
            log.exception("could not prepare the batched decoder")

    def round(self, withdrawn: Sequence[Scheduled], admit: Sequence[Scheduled]) -> None:
        for request in withdrawn:
            self.retire(request, "cancelled", RequestCancelled(WITHDRAWN))
        try:
            for request in admit:
                self._admit(request)
            self.active = [r for r in self.active if not self._retire_if_dropped(r)]
            self._step()
        except Exception as exc:  # a batched step (or a bug): fail what is in flight
            log.exception("batch scheduler round failed")
            for request in self.active + list(admit):
                self.retire(request, "error", exc)  # once each: retired ones are skipped
            self.active = []

    def _admit(self, request: Scheduled) -> None:
        """Prefill `request` and hand over its first token; it joins the batch unless that
        token was its last. A failing prefill fails this request only."""
        engine, config = self.engine, request.config
        if request.dropped():  # withdrawn during this round's calls
            self.retire(request, "cancelled", RequestCancelled(WITHDRAWN))
            return
        try:
            t0 = now()
            prepared = request.engine.start(request.request, stats=request.stats)
        except Exception as exc:
            self.retire(request, "error", exc)
            return
        request.stats.extra["queue_s"] = t0 - request.submitted
        pre = prepared.prefill
        request.cache, request.limit = pre.cache, prepared.limit
        request.position = prepared.position
        decoder = None
        if config.draft is None and config.quantize is None:
            decoder = BatchedDecoder.for_model(engine.model, rows=self.max_batch)
        if decoder is not None:
            self._decoder = decoder
            request.sampler = Sampler(config)
            self._join_arena(request)
        else:
            request.solo = decode_loop(engine.model,
                                       DecodeStart(pre.cache, pre.logits, request.position),
                                       config, config.end_ids(engine.eos_ids),
                                       max_new_tokens=request.limit,
                                       draft_stats=request.draft_stats)
        if self._advance(request, pre.logits):
            self.active.append(request)

    def _join_arena(self, request: Scheduled) -> None:
        """Move a batched request's cache into the arena (one copy), so that the batched step
        attends over all rows at once, and give the prefill's cache back to the pool."""
        cache = request.cache
        if self.arena is None:
            self.arena = BatchArena.for_model(self.engine.model, self.max_batch,
                                               capacity=cache.length + request.limit + 1)
        if not self.arena.fits(cache):  # another dtype or device: it decodes on its own cache
            return
        request.cache = self.arena.join(cache, room=request.limit + 1)
        self.engine.cache_pool.release(cache)

    def _advance(self, request: Scheduled, logits: torch.Tensor | None) -> bool:
        """Hand over `request`'s next token (drawn from `logits`, or from its own decode loop);
        retire it and return False when it has no more."""
        try:
            if request.dropped():
                self.retire(request, "cancelled")
                return False
            if request.batched:
                token = request.sampler(logits) if request.count < request.limit else None
                if token in request.config.end_ids(self.engine.eos_ids):
                    token = None
            else:
                token = next(request.solo, None)
            if token is None:
                self.retire(request, "length" if request.count >= request.limit else "stop")
                return False
            request.count += 1
            request.token = token
            if request.batched and request.count == request.limit:
                self.retire(request, "length", tokens=[token])  # its last: no step for it
                return False
            self._emit(request, RequestOutput(request.id, [token], stats=request.stats))
            return True
        except Exception as exc:
            self.retire(request, "error", exc)
            return False

    def _step(self) -> None:
        """One round: a batched step for the batched requests, one token from every other."""
        batch = [r for r in self.active if r.batched]
        if self.arena is not None:  # in row order, as the step computes them
            batch.sort(key=lambda r: self._row(r))
        keep = []
        if batch:
            with torch.inference_mode():
                logits = self._decoder.step([r.token for r in batch], [r.position for r in batch],
                                      [r.cache for r in batch])
            self.steps += 1
            self.rows += len(batch)
            for i, request in enumerate(batch):
                request.position += 1
                request.steps += 1
                request.batch_sizes += len(batch)
                if self._advance(request, logits[i]):
                    keep.append(request)
        for request in self.active:
            if not request.batched and self._advance(request, None):
                keep.append(request)
        self.active = keep

    def _row(self, request: Scheduled) -> int:
        arena = self.arena
        return arena.row_of(request.cache) if arena is not None and arena.holds(request.cache) \
            else -1

    def _retire_if_dropped(self, request: Scheduled) -> bool:
        if request.dropped():
            self.retire(request, "cancelled")
            return True
        return False

    def retire(self, request: Scheduled, reason: str, error: BaseException | None = None,
                tokens: Sequence[int] = ()) -> None:
        """Give the request's cache back, then send its last output (with its last `tokens`)."""
        if request.finished:
            return
        if request.solo is not None:
            request.solo.close()
        if request.cache is not None:
            if self.arena is not None and self._row(request) >= 0:
                self.arena.leave(request.cache)
            else:
                self.engine.cache_pool.release(request.cache)
            request.cache = None
        if request.steps:
            request.stats.extra["mean_batch_size"] = request.batch_sizes / request.steps
        if request.draft_stats is not None:
            request.stats.extra.update(request.draft_stats.as_dict())
        request.finished = True
        self._on_retired(request)
        self._emit(request, RequestOutput(request.id, list(tokens), finished=True,
                                          finish_reason=reason, error=error,
                                          stats=request.stats))

    def _emit(self, request: Scheduled, output: RequestOutput) -> None:
        try:
            request.on_output(output)
        except Exception:  # the consumer's bug: it loses this request, the batch goes on
            log.exception("the output callback of request %r failed; aborting it", request.id)
            request.aborted = True
