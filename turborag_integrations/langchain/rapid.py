"""RapidChatModel: a LangChain chat model that answers over a long context with RAPID.

    rapid = RapidEngine(TurboRAGEngine())
    llm = RapidChatModel(rapid=rapid, retriever=store.as_retriever())
    llm.invoke(long_document + "\n\n" + question)

The last human message is the long context, a blank line, then the question (earlier
non-system messages join the context). The target reads it all (prefix-cached per context); the
drafter reads what `retriever` returns for the question, or `chunks=` given per call, or the
engine's own retrieval. Stats ride in `response_metadata["rapid"]` (on the last chunk when
streaming).
"""

from __future__ import annotations

import asyncio
from typing import Any, Iterator

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field

from ..core.generate import GenerationConfig
from ..core.rapid import RapidEngine, split_question

_CALL_KWARGS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "chunks", "gamma", "eta"}
_FRAMEWORK_KWARGS = {"stream", "ls_structured_output_format"}


class RapidChatModel(BaseChatModel):
    """Chat model over a RapidEngine. See the module docstring."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rapid: RapidEngine = Field(exclude=True)
    retriever: Any = Field(default=None, exclude=True)
    """A LangChain retriever for the drafter's chunks (None: the engine's own retrieval)."""
    temperature: float = 0.0
    max_tokens: int = 256
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None
    gamma: int | None = None
    eta: float | None = None

    @property
    def _llm_type(self) -> str:
        return "turborag-rapid-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.rapid.target.loaded.name,
                "drafter": self.rapid.drafter.loaded.name, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "gamma": self.gamma or self.rapid.gamma,
                "eta": self.eta if self.eta is not None else self.rapid.eta}

    @staticmethod
    def prompt_of(messages: list[BaseMessage]) -> str:
        return "\n\n".join(m.text for m in messages if m.type != "system" and m.text)

    def _start(self, messages, stop, kwargs):
        unknown = set(kwargs) - _CALL_KWARGS - _FRAMEWORK_KWARGS
        if unknown:
            raise TypeError(f"RapidChatModel got unsupported arguments {sorted(unknown)}")
        context, question = split_question(self.prompt_of(messages))
        chunks = kwargs.get("chunks")
        if chunks is None and self.retriever is not None:
            chunks = self.retriever.invoke(question)
        if chunks is not None:
            chunks = [c.page_content if isinstance(c, Document) else str(c) for c in chunks]
        stops = stop if stop is not None else self.stop
        config = GenerationConfig(
            max_new_tokens=kwargs.get("max_tokens", self.max_tokens),
            temperature=kwargs.get("temperature", self.temperature),
            top_p=kwargs.get("top_p", self.top_p), top_k=kwargs.get("top_k", self.top_k),
            seed=kwargs.get("seed", self.seed), stop=tuple(stops or ()))
        return self.rapid.stream(context, question, chunks=chunks, config=config,
                                 gamma=kwargs.get("gamma", self.gamma),
                                 eta=kwargs.get("eta", self.eta))

    def _metadata(self, stats) -> dict:
        return {"model_name": self.rapid.target.loaded.name, "model_provider": "turborag",
                "finish_reason": stats.finish_reason, "rapid": stats.as_dict()}

    @staticmethod
    def _usage(stats) -> dict:
        return {"input_tokens": stats.target_prompt_tokens, "output_tokens": stats.new_tokens,
                "total_tokens": stats.target_prompt_tokens + stats.new_tokens,
                "input_token_details": {"cache_read": stats.target_reused_tokens}}

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        stream = self._start(messages, stop, kwargs)
        for delta in stream:
            if run_manager:
                run_manager.on_llm_new_token(delta)
        stats = stream.result.stats
        message = AIMessage(content=stream.result.text, response_metadata=self._metadata(stats),
                            usage_metadata=self._usage(stats))
        return ChatResult(generations=[ChatGeneration(
            message=message, generation_info={"finish_reason": stats.finish_reason})])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        stream = self._start(messages, stop, kwargs)
        for delta in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        stats = stream.result.stats
        yield ChatGenerationChunk(
            message=AIMessageChunk(content="", chunk_position="last",
                                   response_metadata=self._metadata(stats),
                                   usage_metadata=self._usage(stats)),
            generation_info={"finish_reason": stats.finish_reason})

    async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs: Any) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)
