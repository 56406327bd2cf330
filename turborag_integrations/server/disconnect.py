"""Noticing that a request's client has left, while the request still waits for its answer.

Once a request's body has been read, the next ASGI `receive()` returns only when the client
disconnects (uvicorn; Starlette's test client when the response is complete). `Disconnection`
waits on it in a task of its own, so a client that leaves is noticed at once, with no polling,
and its request's work is dropped (a completion is aborted by id, server/outputs.py).

A streamed answer is watched by its response once it has started (sse-starlette's
EventSourceResponse cancels it; `EventStream` aborts on close), so a handler leaves this watch
before it returns.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client left before its answer."""


class Disconnection:
    """Watches a request's connection while the `with` block runs; `on_gone` callbacks run (on
    the event loop) when the client leaves. Enter it on the event loop, after the body is read."""

    def __init__(self, request: Request):
        self._receive = request.receive
        self.gone = asyncio.Event()
        self._callbacks: list[Callable[[], None]] = []
        self._task: asyncio.Task | None = None

    def __enter__(self) -> "Disconnection":
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()  # waits in receive(), which holds nothing

    def on_gone(self, callback: Callable[[], None]) -> None:
        """Call `callback` when the client leaves (at once if it has)."""
        if self.gone.is_set():
            callback()
        else:
            self._callbacks.append(callback)

    async def wait(self, work: Awaitable[T]) -> T:
        """`work`'s result, or ClientGone as soon as the client leaves. The work is not
        cancelled then: it runs to its end (a batch being encoded still gets indexed), and its
        result or error is dropped."""
        if self.gone.is_set():  # before it starts: it never does
            if asyncio.iscoroutine(work):
                work.close()
            raise ClientGone
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if self.gone.is_set():
                raise ClientGone
        except BaseException:  # gone, or this handler cancelled: nobody takes the result
            task.add_done_callback(_drop)
            raise
        finally:
            gone.cancel()
        return task.result()

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass  # more of a body already read whole (LimitBody): not ours to read
        self.gone.set()
        for callback in self._callbacks:
            callback()


def _drop(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: no "exception was never retrieved" warning
