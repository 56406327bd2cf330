"""The bodies the server answers with, in OpenAI's shapes: completions and chat completions,
whole or as streamed chunks, their usage, and errors.

Each answer carries the TurboRAG figures of its generation in an extra field, `turborag` (on the
last chunk of a stream): TTFT, tokens reused from the KV store and prefilled, blobs found and
missed, and how long finding the chunks in the prompt took; a RAPID answer's are `RapidStats`
(drafts, acceptance, the policy's decisions), with "mode": "rapid".
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from ..core.errors import ContextWindowError
from ..core.rapid import RapidStats
from ..core.run import GenerationResult, RunStats

STATS_FIELD = "turborag"
# The engine's reasons; a generation cut short by its client is never answered.
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}


def clip(text: str, limit: int = 80) -> str:
    """What an error message echoes of a client's value: its start, never megabytes of it."""
    return text if len(text) <= limit else text[:limit] + "…"


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}
        self.headers = headers or {}

    @classmethod
    def of(cls, exc: BaseException) -> "APIError":
        """The answer to an exception raised while generating."""
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, ContextWindowError):
            return cls(400, str(exc), code="context_length_exceeded")
        return cls(500, f"{type(exc).__name__}: {exc}", type="server_error")

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


def usage(stats: RunStats) -> dict:
    """OpenAI's usage, with the reused prompt tokens as cached tokens (a RAPID answer's prompt
    is its target's: the drafter's is extra work, not the client's prompt)."""
    if isinstance(stats, RapidStats):
        prompt, cached = stats.target_prompt_tokens, stats.target_reused_tokens
    else:
        prompt, cached = stats.prompt_tokens, stats.reused_tokens
    return {"prompt_tokens": prompt, "completion_tokens": stats.new_tokens,
            "total_tokens": prompt + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def figures(stats: RunStats) -> dict:
    """The `turborag` field of an answer: its generation's stats."""
    out = stats.as_dict()
    if isinstance(stats, RapidStats):
        out["mode"] = "rapid"
    return out


def event_data(data: dict | str) -> str:
    """The data of one server-sent event: a JSON object, or a bare word ([DONE])."""
    return data if isinstance(data, str) else json.dumps(data)


@dataclass
class Reply:
    """The bodies of one answer: a chat completion (`chat`) or a text completion."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, choice: dict, *, chunk: bool) -> dict:
        kind = "chat.completion" + (".chunk" if chunk else "") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [{"index": 0, **choice, "logprobs": None}]}

    def body(self, result: GenerationResult) -> dict:
        """The whole answer."""
        reason = FINISH_REASONS.get(result.stats.finish_reason, "stop")
        content = ({"message": {"role": "assistant", "content": result.text}} if self.chat
                   else {"text": result.text})
        out = self._envelope({**content, "finish_reason": reason}, chunk=False)
        out["usage"] = usage(result.stats)
        out[STATS_FIELD] = figures(result.stats)
        return out

    def chunk(self, text: str, *, finish_reason: str | None = None, first: bool = False) -> dict:
        """A streamed piece of text (`first`: the chat stream's opening, which names the role)."""
        if not self.chat:
            return self._envelope({"text": text, "finish_reason": finish_reason}, chunk=True)
        delta = {"role": "assistant", "content": text} if first else (
            {"content": text} if text else {})
        return self._envelope({"delta": delta, "finish_reason": finish_reason}, chunk=True)

    def opening(self) -> list[dict]:
        return [self.chunk("", first=True)] if self.chat else []

    def closing(self, result: GenerationResult, *, include_usage: bool) -> list[dict]:
        """The last chunks: the finish reason, and usage with the TurboRAG figures.

        With `include_usage` (stream_options), usage comes in a chunk of its own with no
        choices, as OpenAI sends it; otherwise on the finishing chunk.
        """
        finishing = self.chunk("", finish_reason=FINISH_REASONS.get(result.stats.finish_reason,
                                                                    "stop"))
        last = {**finishing, "choices": []} if include_usage else finishing
        last["usage"] = usage(result.stats)
        last[STATS_FIELD] = figures(result.stats)
        return [finishing, last] if include_usage else [last]


class EventStream(EventSourceResponse):
    """Server-sent events (`events`: each one's data) that call `on_close` however the response
    ends (the server aborts the request's generation there).

    A client that disconnects makes the response cancel its body while it waits for the next
    delta; the body is left suspended, so this is where the generation learns it. The bytes are
    OpenAI's: no keep-alive comments, and lines end in a bare newline. On shutdown a stream under
    way runs to its end, as any other request does (uvicorn's --timeout-graceful-shutdown bounds
    both), rather than being cut at once, sse-starlette's default.
    """

    def __init__(self, events, on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache"}, ping=0, sep="\n",
                         shutdown_grace_period=math.inf)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
