"""What TurboRAGLLM and RapidLLM share: the sampling fields and the completion/chat plumbing.

Both answer through an engine's `GenerationStream` of text deltas. A subclass turns a prompt
into that stream (`open_stream`) and says what its result reports (`_stats`); this base makes
the LlamaIndex responses from it, for `complete`, `chat`, their streaming forms and their async
forms: cumulative text with each delta, then a last response (empty delta) that carries the
stats in `additional_kwargs[stats_key]`.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Iterator, List, Optional, Sequence

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen,
                                              ChatResponseGen, CompletionResponse,
                                              CompletionResponseAsyncGen, CompletionResponseGen,
                                              MessageRole)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from ..core.async_iter import iterate_in_thread
from ..core.run import GenerationStream
from ..core.settings import GenerationConfig


def config_from(llm: Any, kwargs: dict, names: Sequence[str]) -> GenerationConfig:
    """A GenerationConfig from the LLM's fields `names`, overridden by per-call kwargs (by
    those names, or the OpenAI-style `max_tokens`)."""
    call = {k: v for k, v in kwargs.items() if k in names or k == "max_tokens"}
    return GenerationConfig.from_options({name: getattr(llm, name) for name in names}, call)


class StreamingLLM(CustomLLM):
    """A LlamaIndex LLM over an engine stream. See the module docstring."""

    stats_key: ClassVar[str] = "turborag"
    # The fields a call's kwargs may override, by GenerationConfig's names.
    config_fields: ClassVar[tuple[str, ...]] = ("max_new_tokens", "temperature", "top_p",
                                                "top_k", "seed", "stop")

    max_new_tokens: int = Field(default=256, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: Optional[int] = None
    stop: List[str] = Field(default_factory=list)

    _last: Any = PrivateAttr(default=None)

    # ---- what a subclass provides -------------------------------------------------------------
    def open_stream(self, prompt: str, kwargs: dict) -> GenerationStream:
        """The engine stream that answers `prompt` (called when the first delta is asked for)."""
        raise NotImplementedError

    def _stats(self, result: Any) -> dict:
        """What the finished generation reports in `additional_kwargs[stats_key]`."""
        raise NotImplementedError

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        raise NotImplementedError

    def completion_prompt(self, prompt: str, formatted: bool = False) -> str:
        return prompt

    # ---- shared ---------------------------------------------------------------------------
    @property
    def last_result(self) -> Any:
        """The last finished generation (text, token ids, stats) of this LLM object."""
        return self._last

    def generation_config(self, kwargs: dict) -> GenerationConfig:
        return config_from(self, kwargs, self.config_fields)

    def _generate(self, prompt: str, **kwargs: Any) -> Iterator[CompletionResponse]:
        """Deltas as CompletionResponses, then a last one (empty delta) carrying the stats.
        Closing it early closes the engine's stream, which releases its KV cache."""
        stream = self.open_stream(prompt, kwargs)
        text = ""
        try:
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
        finally:
            stream.close()
        result = stream.result
        self._last = result
        yield CompletionResponse(text=result.text, delta="",
                                 additional_kwargs={self.stats_key: self._stats(result)})

    def _complete(self, prompt: str, **kwargs: Any) -> CompletionResponse:
        last = None
        for last in self._generate(prompt, **kwargs):
            pass
        return last  # type: ignore[return-value]

    @staticmethod
    def _as_chat(response: CompletionResponse) -> ChatResponse:
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=response.text),
                            delta=response.delta, additional_kwargs=response.additional_kwargs)

    def _chat_stream(self, prompt: str, **kwargs: Any) -> Iterator[ChatResponse]:
        for response in self._generate(prompt, **kwargs):
            yield self._as_chat(response)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(self.completion_prompt(prompt, formatted), **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        return self._generate(self.completion_prompt(prompt, formatted), **kwargs)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._as_chat(self._complete(self.chat_prompt(messages), **kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._chat_stream(self.chat_prompt(messages), **kwargs)

    # Async: the model runs in a worker thread, so the event loop keeps serving while it
    # prefills and decodes; a stream keeps one thread for all its tokens (core/async_iter.py).
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, self.completion_prompt(prompt, formatted),
                                       **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        prompt = self.completion_prompt(prompt, formatted)
        return iterate_in_thread(lambda: self._generate(prompt, **kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = await asyncio.to_thread(self._complete, self.chat_prompt(messages), **kwargs)
        return self._as_chat(response)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        prompt = self.chat_prompt(messages)
        return iterate_in_thread(lambda: self._chat_stream(prompt, **kwargs))
