"""Async iteration over a blocking iterator (the engine's decode loop) without blocking the loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator

_DONE = object()


async def iterate_in_thread(make_iterator) -> AsyncIterator[Any]:
    """Drive a blocking iterator in one worker thread, handing items to the event loop.

    One thread for the whole iteration (not one executor hop per item): the decode loop keeps
    its torch state on one thread, and the event loop stays free between tokens.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def post(item, exc=None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, exc))
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            cancelled.set()

    def run() -> None:
        iterator = None
        try:
            iterator = make_iterator()
            for item in iterator:
                if cancelled.is_set():
                    break
                post(item)
        except BaseException as exc:  # re-raised in the consumer
            post(_DONE, exc)
            return
        finally:
            close = getattr(iterator, "close", None)
            if close:
                close()
        post(_DONE)

    worker = threading.Thread(target=run, name="turborag-stream", daemon=True)
    worker.start()
    try:
        while True:
            item, exc = await queue.get()
            if item is _DONE:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        cancelled.set()
