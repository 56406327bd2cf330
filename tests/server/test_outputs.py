"""The output loop: the scheduler's token ids turned into each request's events on the event loop.

A scripted worker hands over the token ids a test chooses, one output at a time from a thread of
its own (the tiny models' tokenizer has a token per UTF-8 byte, so a character or a stop string
spans several); the real scheduler shows abort by id, errors and where the text is made."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from tests.conftest import byte_tokenizer
from turborag_integrations.core.batching import BatchScheduler, RequestOutput
from turborag_integrations.core.errors import ContextWindowError
from turborag_integrations.core.request import Request
from turborag_integrations.core.run import GenerationStats
from turborag_integrations.core.settings import GenerationConfig
from turborag_integrations.server.outputs import OutputLoop

QUIET_S = 0.05  # how long a test waits to see that no event comes


class ScriptedWorker:
    """Stands in for the batch scheduler: keeps each request's callback, and reports the outputs
    a test gives it from a thread of its own, as the worker does."""

    def __init__(self, tokenizer):
        self.engine = SimpleNamespace(tokenizer=tokenizer)
        self.callbacks: dict = {}
        self.aborted: list[str] = []
        self.stats = GenerationStats()

    def add_request(self, request_id, request, *, on_output) -> None:
        self.callbacks[request_id] = on_output

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True

    def report(self, request_id: str, tokens=(), **last) -> None:
        output = RequestOutput(request_id, list(tokens), stats=self.stats,
                               finished=bool(last), **last)
        thread = threading.Thread(target=self.callbacks[request_id], args=(output,))
        thread.start()
        thread.join()


@pytest.fixture
def tokenizer():
    return byte_tokenizer()


def ids(tokenizer, text: str) -> list[int]:
    out = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(out) == len(text.encode())  # a token per byte
    return out


async def event_soon(stream):
    """The stream's next event, or None when none comes within QUIET_S."""
    try:
        return await asyncio.wait_for(stream.next(), QUIET_S)
    except asyncio.TimeoutError:
        return None


async def rest(stream) -> list:
    events = []
    while (event := await asyncio.wait_for(stream.next(), 30)) is not None:
        events.append(event)
    return events


def test_a_character_split_across_tokens_waits_for_its_last_byte(tokenizer):
    text = "Café ☕ and 𝄞!"  # é: 2 bytes, ☕: 3, 𝄞: 4
    tokens = ids(tokenizer, text)
    worker = ScriptedWorker(tokenizer)

    async def run():
        outputs = OutputLoop(worker)
        stream = outputs.add("r", Request("prompt", config=GenerationConfig(max_new_tokens=64)))
        raw = b""
        for token, byte in zip(tokens, text.encode()):
            worker.report("r", [token])
            raw += bytes([byte])
            event = await event_soon(stream)
            try:
                char = raw.decode()[-1]
            except UnicodeDecodeError:  # a character's first bytes: nothing yet
                assert event is None
            else:
                assert event == ("delta", char)
        worker.report("r", finish_reason="length")
        return await rest(stream), len(outputs)

    events, in_flight = asyncio.run(run())
    (kind, result), = events
    assert kind == "done" and result.text == text and result.token_ids == tokens
    assert result.stats.finish_reason == "length" and result.stats.new_tokens == len(tokens)
    assert in_flight == 0 and worker.aborted == []


def test_a_stop_string_split_across_tokens_is_cut_and_ends_the_request_by_id(tokenizer):
    worker = ScriptedWorker(tokenizer)
    config = GenerationConfig(max_new_tokens=64, stop=["STOP"])

    async def run():
        outputs = OutputLoop(worker)
        stream = outputs.add("r", Request("prompt", config=config))
        deltas = []
        for token in ids(tokenizer, "It is STOP"):
            worker.report("r", [token])
            event = await event_soon(stream)
            if event is not None:
                deltas.append(event[1])
        aborted = list(worker.aborted)
        # the worker decodes on until its next round, then reports the request's end
        worker.report("r", ids(tokenizer, " and"))
        assert await event_soon(stream) is None
        worker.report("r", finish_reason="cancelled")
        return deltas, aborted, await rest(stream)

    deltas, aborted, events = asyncio.run(run())
    assert "".join(deltas) == "It is " and aborted == ["r"]
    (kind, result), = events
    assert kind == "done" and result.text == "It is " and result.stats.finish_reason == "stop"
    assert result.token_ids == ids(tokenizer, "It is STOP")


def test_a_held_back_start_of_a_stop_string_comes_out_when_the_answer_ends(tokenizer):
    worker = ScriptedWorker(tokenizer)

    async def run():
        outputs = OutputLoop(worker)
        stream = outputs.add("r", Request("p", config=GenerationConfig(max_new_tokens=9,
                                                                       stop=["STOP"])))
        worker.report("r", ids(tokenizer, "Almost ST"), finish_reason="length")
        return await rest(stream)

    events = asyncio.run(run())
    deltas = [text for kind, text in events[:-1]]
    assert "".join(deltas[:-1]) == "Almost " and deltas[-1] == "ST"  # held until the end
    assert events[-1][0] == "done" and events[-1][1].text == "Almost ST"
    assert worker.aborted == []


def test_an_error_part_way_ends_the_stream_after_its_text(tokenizer):
    worker = ScriptedWorker(tokenizer)
    ended = []

    async def run():
        outputs = OutputLoop(worker)
        stream = outputs.add("r", Request("p", config=GenerationConfig(max_new_tokens=9)),
                             on_end=ended.append)
        worker.report("r", ids(tokenizer, "ab"))
        worker.report("r", finish_reason="error", error=RuntimeError("the step broke"))
        return await rest(stream), await stream.next()

    events, after = asyncio.run(run())
    assert events[:2] == [("delta", "a"), ("delta", "b")]
    assert events[2][0] == "error" and "broke" in str(events[2][1]) and after is None
    (result,) = ended  # counted, as the stream counts a run that fails part-way
    assert result.text == "ab" and result.stats.finish_reason == "length"


def test_a_finished_stream_is_closed_and_late_outputs_are_dropped(tokenizer):
    worker = ScriptedWorker(tokenizer)

    async def run():
        outputs = OutputLoop(worker)
        stream = outputs.add("r", Request("p", config=GenerationConfig(max_new_tokens=2)))
        worker.report("r", ids(tokenizer, "ok"), finish_reason="length")
        events = await rest(stream)
        worker.report("r", ids(tokenizer, "late"))  # no request of that id any more
        return events, await event_soon(stream), await stream.next(), len(outputs)

    events, late, again, in_flight = asyncio.run(run())
    assert events == [("delta", "o"), ("delta", "k"), ("done", events[-1][1])]
    assert late is None and again is None and in_flight == 0
    # a worker that reports to an event loop that has closed aborts the request by id
    worker.report("r", ids(tokenizer, "x"))
    assert worker.aborted == ["r"]


# ---- on the real scheduler ------------------------------------------------------------------

def test_abort_by_id_ends_the_stream_and_frees_the_place(engine):
    ended = []
    long = GenerationConfig(max_new_tokens=1500)  # seconds of decoding: it never ends alone

    async def run():
        scheduler = BatchScheduler(engine, max_batch=1)
        try:
            outputs = OutputLoop(scheduler)
            first = outputs.add("first", Request("Tell me everything.", config=long),
                                on_end=ended.append)
            queued = outputs.add("queued", Request("And then some more.", config=long),
                                 on_end=ended.append)
            assert (await first.next())[0] == "delta"  # it holds the one place
            outputs.abort("queued")
            assert await queued.next() is None and await queued.next() is None
            outputs.abort("first")
            assert await first.next() is None
            for _ in range(600):  # the worker's last outputs: it let go of both
                if not len(outputs):
                    break
                await asyncio.sleep(0.05)
            freed = (len(outputs), scheduler.in_flight, scheduler.waiting)
            third = outputs.add("third",
                                Request("Short.", config=GenerationConfig(max_new_tokens=3)))
            return freed, await rest(third)
        finally:
            scheduler.close()

    freed, events = asyncio.run(run())
    assert freed == (0, 0, 0)
    (result,) = ended  # the queued one was never prefilled: no generation to count
    assert result.stats.finish_reason == "cancelled" and 1 <= result.stats.new_tokens < 1500
    assert events[-1][0] == "done" and events[-1][1].stats.new_tokens == 3


def test_a_prefill_error_is_the_first_event_and_counts_no_generation(engine):
    ended = []

    async def run():
        with BatchScheduler(engine) as scheduler:
            too_long = Request("x" * (engine.context_window + 10),
                               config=GenerationConfig(max_new_tokens=4))
            stream = OutputLoop(scheduler).add("r", too_long, on_end=ended.append)
            return await rest(stream)

    (kind, error), = asyncio.run(run())
    assert kind == "error" and isinstance(error, ContextWindowError) and ended == []


def test_text_is_made_on_the_event_loop_never_on_the_worker(engine, monkeypatch):
    decoding, decode = set(), engine.tokenizer.decode
    monkeypatch.setattr(engine.tokenizer, "decode", lambda *a, **k: (
        decoding.add(threading.current_thread().name), decode(*a, **k))[1])

    async def run():
        with BatchScheduler(engine, name="the-worker") as scheduler:
            stream = OutputLoop(scheduler).add(
                "r", Request("Hello.", config=GenerationConfig(max_new_tokens=8)))
            return await rest(stream)

    events = asyncio.run(run())
    assert events[-1][0] == "done" and events[-1][1].stats.new_tokens == 8
    assert decoding == {threading.current_thread().name}  # the event loop's, in this test
