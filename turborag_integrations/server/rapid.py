"""RAPID answers over HTTP: a chat completion that asks for them with `"turborag_rapid": true`.

    turborag serve --rapid-drafter self             # or a smaller model of the same family
    POST /v1/chat/completions  {"model": …, "turborag_rapid": true, "messages": [
        {"role": "system", "content": "…"},                           (optional)
        {"role": "user", "content": LONG_CONTEXT + "\\n\\n" + QUESTION}]}

The target (the served model) reads exactly the prompt those messages render to; the drafter
reads the chunks `RapidEngine` retrieves from the context itself (core/rapid). So a request
holds a system message at most and one user message whose text is the context, a blank line,
then the question (split at its last blank line, as `split_question` splits), and the prompt
`RapidEngine.render` makes of those parts must be the one the server renders of the messages;
anything else is a 400 that says so.

The model belongs to the batch scheduler's thread, so a RAPID answer runs there too, a step at
a time (`RapidRun`: one `scheduler.call` per text delta, most often one speculative round); the
batch's requests decode between two steps. One RAPID answer runs at a time (`RapidAnswers`),
since each holds two caches of a long context; the next waits, counted among the requests
waiting for the model. A greedy answer at η = 0 is the target's own, whatever runs beside it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from fastapi import Request
from starlette.responses import Response

from ..core.batching import BatchScheduler
from ..core.config import EngineConfig
from ..core.engine import TurboRAGEngine
from ..core.errors import ModelError
from ..core.rapid import RapidEngine, RapidStats
from ..core.run import GenerationResult, GenerationStream
from .disconnect import Disconnection
from .outputs import Event
from .responses import APIError, Reply
from .schemas import ChatCompletionRequest
from .service import Service

log = logging.getLogger("turborag.server")

SELF = "self"  # the drafter that is the served model itself
NO_DRAFTER = ("this server answers no RAPID requests: start it with `turborag serve "
              "--rapid-drafter MODEL` (`self`: the served model drafts for itself)")
FORM = ("a RAPID request's messages are an optional system message and one user message whose "
        "text is the long context, a blank line, then the question")


def load_rapid(engine: TurboRAGEngine, drafter: str) -> RapidEngine:
    """RAPID over the served `engine`, with `drafter` drafting: "self" (the engine itself), or
    a model loaded as the engine's was (its device, dtype and from_pretrained kwargs) onto the
    engine's KV store. It must share the engine's vocabulary (`VocabularyMismatch`). Loads on
    the calling thread: call it on one that ends (`core.batching.on_own_thread`)."""
    if drafter == SELF:
        rapid = RapidEngine(engine)
    else:
        try:
            loaded = TurboRAGEngine(drafter, store=engine.store,
                                    config=EngineConfig(model=engine.config.model))
        except Exception as exc:
            raise ModelError(f"the RAPID drafter {drafter!r} did not load: {exc}") from exc
        try:
            rapid = RapidEngine(engine, loaded)
        except BaseException:
            loaded.close()
            raise
    # the drafter's retrieval embeds with it: loaded here, not on the model's thread at the
    # first answer
    rapid.embedder  # noqa: B018
    return rapid


@dataclass(frozen=True)
class RapidPrompt:
    """The parts of a RAPID request's prompt; system "" for none."""

    system: str
    context: str
    question: str


def refusal(req: ChatCompletionRequest) -> tuple[str, str] | None:
    """(param, message) of the first field a RAPID request may not combine with; None if none."""
    if req.turborag_mode == "naive":
        return "turborag_mode", ("turborag_rapid asks for RAPID and turborag_mode \"naive\" for "
                                 "a plain prefill: send one of them")
    if req.turborag_recovery is not None:
        return "turborag_recovery", ("turborag_recovery does not apply to RAPID (its target "
                                     "reads the whole context): leave it out")
    if req.turborag_chunks:
        return "turborag_chunks", ("RAPID's drafter retrieves its chunks from the context "
                                   "itself: leave turborag_chunks out")
    if req.cache_salt is not None:
        return "cache_salt", "RAPID's caches are not split by cache_salt: leave it out"
    return None


def rapid_prompt(req: ChatCompletionRequest, prompt: str, rapid: RapidEngine) -> RapidPrompt:
    """The system turn, context and question of a RAPID request whose messages render to
    `prompt`; APIError 400 when they are not of the accepted form (`FORM`)."""
    chat = req.chat()
    system = chat[0]["content"] if chat[0]["role"] == "system" else None
    turns = chat[1:] if system is not None else chat
    if [m["role"] for m in turns] != ["user"]:
        roles = ", ".join(m["role"] for m in chat)
        raise APIError(400, f"{FORM}; these are: {roles}", param="messages",
                       code="invalid_rapid_messages")
    # split_question's split (the last blank line), its white space kept: the parts joined
    # again are the text sent
    context, blank, question = turns[0]["content"].rpartition("\n\n")
    if not (blank and context.strip() and question.strip()):
        raise APIError(400, f"{FORM}; this user message has no blank line with text on both "
                       "sides", param="messages", code="invalid_rapid_messages")
    parts = RapidPrompt(system or "", context, question)
    try:
        rendered = "".join(rapid.render(rapid.target, context, question, parts.system))
    except ValueError:  # a chat template that does not keep the context verbatim
        rendered = None
    if rendered != prompt:
        raise APIError(400, f"{FORM}: RAPID's target would read another prompt than these "
                       "messages render to", param="messages", code="invalid_rapid_messages")
    return parts


class RapidRun:
    """One RAPID answer, run on the model's thread a step at a time (`scheduler.call`; a step
    is the stream's next text delta). Its events are read as a RequestStream's (`next`); the
    answer runs on whether or not they are read, until it ends or `abort()`. Make it on the
    event loop."""

    def __init__(self, stream: GenerationStream, scheduler: BatchScheduler,
                 on_end: Callable[[GenerationResult], None], release: Callable[[], None]):
        """on_end: called with the result of an answer that was prefilled, however it ended;
        release: called once the answer holds nothing on the model's thread any more."""
        self.aborted = False
        self._events: asyncio.Queue[Event | None] = asyncio.Queue()
        # kept: the event loop holds only a weak reference to a task
        self._task = asyncio.get_running_loop().create_task(
            self._run(stream, scheduler, on_end, release))

    async def next(self) -> Event | None:
        """The next event; None once aborted."""
        if self.aborted:
            return None
        return await self._events.get()

    def abort(self) -> None:
        """Its reader has gone: stop after the step under way, and give the reader None."""
        if not self.aborted:
            self.aborted = True
            self._events.put_nowait(None)

    async def _run(self, stream: GenerationStream, scheduler: BatchScheduler,
                   on_end: Callable[[GenerationResult], None],
                   release: Callable[[], None]) -> None:
        last: Event | None = None  # stays None when aborted (or torn down) before its end
        try:
            last = await self._steps(stream, scheduler)
        except Exception as exc:  # in its prefill (an HTTP error), or after (the stream's last)
            last = ("error", exc)
        finally:
            try:
                if last is None:  # its caches go back to the pools where it runs
                    await _close(stream, scheduler)
            finally:
                release()  # the next RAPID answer may start
                if stream.result is not None:  # prefilled: counted, however it ended
                    on_end(stream.result)
                self._events.put_nowait(last)  # None: a reader still waiting learns it ended

    async def _steps(self, stream: GenerationStream, scheduler: BatchScheduler) -> Event | None:
        """Step the answer on the model's thread, its deltas into the events, until it ends
        ("done") or is aborted (None)."""
        deltas = iter(stream)
        while not self.aborted:
            delta = await asyncio.wrap_future(scheduler.call(lambda: next(deltas, None)))
            if delta is None:  # the stream yields no empty delta
                return "done", stream.result
            self._events.put_nowait(("delta", delta))
        return None


async def _close(stream: GenerationStream, scheduler: BatchScheduler) -> None:
    """Close `stream` on the model's thread, where it runs (after any step under way)."""
    try:
        future = scheduler.call(stream.close)
    except RuntimeError:  # the scheduler has stopped: no other thread runs the model now
        stream.close()
        return
    await asyncio.wrap_future(future)


class RapidAnswers:
    """An app's RAPID answers, one at a time: `complete` checks a request, then answers it as
    the service answers the others (queue, disconnection, bodies and streams)."""

    def __init__(self, rapid: RapidEngine, service: Service):
        self.rapid = rapid
        self.service = service
        self._turn = asyncio.Lock()  # held by the RAPID answer under way

    async def complete(self, request: Request, req: ChatCompletionRequest, prompt: str,
                       reply: Reply) -> Response:
        """Answer a RAPID request whose messages render to `prompt`."""
        refused = refusal(req)
        if refused is not None:
            param, message = refused
            raise APIError(400, message, param=param, code="unsupported_parameter")
        parts = rapid_prompt(req, prompt, self.rapid)
        options = req.turborag_rapid
        stream = self.rapid.stream(parts.context, parts.question,
                                   config=self.service.generation_config(req),
                                   gamma=options.gamma, eta=options.eta, system=parts.system)

        async def submit(client: Disconnection):
            await self._take_turn(client)
            run = RapidRun(stream, self.service.scheduler,
                           on_end=lambda result: self._ended(result, reply.id),
                           release=self._turn.release)
            return run, run.abort

        return await self.service.answer(request, req, reply, submit)

    async def _take_turn(self, client: Disconnection) -> None:
        """Wait for the turn; a client that leaves meanwhile (ClientGone) gives up its place
        without taking it."""
        waiting = asyncio.ensure_future(self._turn.acquire())
        try:
            await client.wait(waiting)
        except BaseException:
            if not waiting.cancel() and not waiting.cancelled() and waiting.exception() is None:
                self._turn.release()  # it had the turn already
            raise

    def _ended(self, result: GenerationResult, label: str) -> None:
        stats: RapidStats = result.stats  # type: ignore[assignment]
        self.service.metrics.rapid(stats)
        log.info("%s: %s after %d tokens (rapid: %d of %d drafts accepted, %d target prompt "
                 "tokens)", label, stats.finish_reason, stats.new_tokens, stats.accepted,
                 stats.drafted, stats.target_prompt_tokens)
