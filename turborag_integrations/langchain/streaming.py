"""From an engine's stream of text deltas to LangChain chunks, results and async streams.

Every TurboRAG LangChain model answers through a `GenerationStream`: text deltas, then `.result`
with the stats. `chunks_of` turns that into LangChain chunks (the stats ride on a last, empty
chunk, since they exist only once decoding is over); the non-streaming result is those chunks
merged, and the async forms run the same sync stream in one worker thread
(core/async_iter.py).
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable, Iterator, TypeVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel, generate_from_stream
from langchain_core.messages import AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGenerationChunk, ChatResult

from ..core.async_iter import iterate_in_thread
from ..core.run import GenerationResult, GenerationStream

C = TypeVar("C")


def chunks_of(stream: GenerationStream, chunk: Callable[[str], C],
              last: Callable[[GenerationResult], C],
              run_manager: CallbackManagerForLLMRun | None) -> Iterator[C]:
    """`chunk(delta)` for each text delta of `stream`, then `last(result)`; each is reported to
    the run's callbacks as it is yielded. Closing the iterator early closes the stream, which
    ends decoding and releases its KV cache."""
    try:
        for delta in stream:
            piece = chunk(delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=piece)
            yield piece
    finally:
        stream.close()
    final = last(stream.result)
    if run_manager:
        run_manager.on_llm_new_token("", chunk=final)
    yield final


async def threaded_chunks(make_chunks: Callable[[], Iterator[C]],
                          run_manager: AsyncCallbackManagerForLLMRun | None) -> AsyncIterator[C]:
    """The chunks of `make_chunks()` (a sync chunk iterator) made in one worker thread, each
    reported to the run's async callbacks. Closing this closes that iterator (see
    `iterate_in_thread`)."""
    async with aclosing(iterate_in_thread(make_chunks)) as chunks:
        async for piece in chunks:
            if run_manager:
                await run_manager.on_llm_new_token(piece.text, chunk=piece)
            yield piece


class StreamingChatModel(BaseChatModel):
    """A chat model whose answer is an engine stream of text deltas.

    Subclasses open the stream (`open_stream`) and say what its stats report
    (`response_metadata`, `usage_metadata`); what LangChain calls is derived here: `_stream`
    yields the chunks, `_generate` merges them, and the async forms run the same in a worker
    thread.
    """

    def open_stream(self, messages: list[BaseMessage], stop: list[str] | None,
                    kwargs: dict) -> GenerationStream:
        raise NotImplementedError

    def response_metadata(self, stats: Any) -> dict:
        raise NotImplementedError

    def usage_metadata(self, stats: Any) -> dict:
        raise NotImplementedError

    def _last_chunk(self, result: GenerationResult) -> ChatGenerationChunk:
        stats = result.stats
        return ChatGenerationChunk(
            message=AIMessageChunk(content="", chunk_position="last",
                                   response_metadata=self.response_metadata(stats),
                                   usage_metadata=self.usage_metadata(stats)),
            generation_info={"finish_reason": stats.finish_reason})

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        return chunks_of(self.open_stream(messages, stop, kwargs),
                         lambda delta: ChatGenerationChunk(message=AIMessageChunk(content=delta)),
                         self._last_chunk, run_manager)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                 run_manager: AsyncCallbackManagerForLLMRun | None = None,
                 **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        return threaded_chunks(lambda: self._stream(messages, stop, None, **kwargs), run_manager)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)
