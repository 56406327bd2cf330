"""TurboRAGLLM: the text-completion (string in, string out) counterpart of the chat model.

For prompts that are already complete strings, e.g. a `PromptTemplate` written for a base model:
no chat template is applied, everything else (chunk lookup, stats) is the chat model's.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterator

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from .async_iter import iterate_in_thread
from .generation import TurboRAGParams


class TurboRAGLLM(TurboRAGParams, BaseLLM):
    """Text completion over a TurboRAGEngine; `generation_info["turborag"]` holds the stats."""

    @property
    def _llm_type(self) -> str:
        return "turborag-llm"

    def _info(self, stats) -> dict:
        return {"finish_reason": stats.finish_reason, **self.response_metadata(stats),
                "usage_metadata": self.usage_metadata(stats)}

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        generations = []
        for prompt in prompts:
            stream = self.start(prompt, stop, kwargs)
            for delta in stream:
                if run_manager:
                    run_manager.on_llm_new_token(delta)
            generations.append([Generation(text=stream.result.text,
                                           generation_info=self._info(stream.result.stats))])
        return LLMResult(generations=generations)

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        stream = self.start(prompt, stop, kwargs)
        for delta in stream:
            chunk = GenerationChunk(text=delta)
            if run_manager:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield GenerationChunk(text="", generation_info=self._info(stream.result.stats))

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        async for chunk in iterate_in_thread(lambda: self._stream(prompt, stop, None, **kwargs)):
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> LLMResult:
        return await asyncio.to_thread(self._generate, prompts, stop, None, **kwargs)
