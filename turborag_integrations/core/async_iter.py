"""Async iteration over a blocking iterator (the engine's decode loop) without blocking the loop.

Both framework adapters serve their async streams through `iterate_in_thread`; nothing here
knows a framework.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Callable, Iterable, TypeVar

T = TypeVar("T")

_DONE = object()


async def iterate_in_thread(make_iterator: Callable[[], Iterable[T]]) -> AsyncIterator[T]:
    """Drive a blocking iterator in one worker thread, handing its items to the event loop.

    One thread for the whole iteration, not one executor hop per item: the decode loop keeps
    its torch state on one thread, and the event loop stays free between tokens. The iterator
    is made, advanced and closed in that thread (a generator cannot be closed from another
    thread while it runs).

    Closing this async iterator early (a consumer that breaks and closes it, or a cancelled
    task) stops the worker after the item it is computing, closes the iterator there, and
    returns once that is done: the engine's stream releases its KV cache when it is closed, so
    a next call finds it free.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def post(item, error: BaseException | None = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, error))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            stop.set()

    def work() -> None:
        error = None
        try:
            iterator = iter(make_iterator())
            try:
                for item in iterator:
                    if stop.is_set():
                        break
                    post(item)
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
        except BaseException as exc:  # re-raised in the consumer
            error = exc
        post(_DONE, error)

    threading.Thread(target=work, name="turborag-stream", daemon=True).start()
    finished = False
    try:
        while True:
            item, error = await queue.get()
            if item is _DONE:
                finished = True
                if error is not None:
                    raise error
                return
            yield item
    finally:
        if not finished:
            stop.set()
            while (await queue.get())[0] is not _DONE:  # the worker has closed the iterator
                pass
