"""TurboRAGChatModel: a LangChain chat model that reuses cached document KV inside its prompts.

The messages are rendered through the model's own chat template, then the engine looks for the
texts of known documents (the registry the vector store wrapper fills, plus any `chunks=`) in
the rendered prompt, stitches their stored KV blobs in, and prefills only the rest. Text it does
not find verbatim is prefilled like any other text, so no prompt can make it fail.

    llm = TurboRAGChatModel(engine=engine)
    msg = llm.invoke(messages)
    msg.response_metadata["turborag"]["reused_tokens"]
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterator

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from .async_iter import iterate_in_thread
from .generation import TurboRAGParams

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}
_MEDIA_BLOCKS = {"image", "image_url", "audio", "input_audio", "file", "video"}


def to_chat(messages: list[BaseMessage]) -> list[dict]:
    """LangChain messages as the role/content dicts a chat template expects (text only)."""
    out = []
    for m in messages:
        role = m.role if isinstance(m, ChatMessage) else _ROLES.get(m.type)
        if role is None:
            raise ValueError(f"TurboRAGChatModel cannot render a {type(m).__name__} "
                             f"(type {m.type!r}); use system, human, ai or tool messages")
        if isinstance(m.content, list):
            media = [b.get("type") for b in m.content
                     if isinstance(b, dict) and b.get("type") in _MEDIA_BLOCKS]
            if media:
                raise ValueError(f"TurboRAGChatModel takes text only; the message holds {media}")
        out.append({"role": role, "content": m.text})
    return out


class TurboRAGChatModel(TurboRAGParams, BaseChatModel):
    """Chat model over a TurboRAGEngine. See the module docstring."""

    @property
    def _llm_type(self) -> str:
        return "turborag-chat"

    def render(self, messages: list[BaseMessage]) -> str:
        """The exact prompt text the model sees (chat template applied)."""
        return self.get_engine().render_chat(to_chat(messages))

    # ---- sync -----------------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        stream = self.start(self.render(messages), stop, kwargs)
        for delta in stream:
            if run_manager:
                run_manager.on_llm_new_token(delta)
        stats = stream.result.stats
        message = AIMessage(content=stream.result.text,
                            response_metadata=self.response_metadata(stats),
                            usage_metadata=self.usage_metadata(stats))
        return ChatResult(generations=[ChatGeneration(
            message=message, generation_info={"finish_reason": stats.finish_reason})])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        stream = self.start(self.render(messages), stop, kwargs)
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        # Stats exist only once decoding is over: they ride on a last, empty chunk.
        stats = stream.result.stats
        last = ChatGenerationChunk(
            message=AIMessageChunk(content="", chunk_position="last",
                                   response_metadata=self.response_metadata(stats),
                                   usage_metadata=self.usage_metadata(stats)),
            generation_info={"finish_reason": stats.finish_reason})
        if run_manager:
            run_manager.on_llm_new_token("", chunk=last)
        yield last

    # ---- async: the sync generator runs in a worker thread --------------------------------
    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._stream(messages, stop, None, **kwargs)):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)
