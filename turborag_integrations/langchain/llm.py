"""TurboRAGLLM: the text-completion (string in, string out) counterpart of the chat model.

For prompts that are already complete strings, e.g. a `PromptTemplate` written for a base model:
no chat template is applied, everything else (chunk lookup, stats) is the chat model's.
"""

from __future__ import annotations

import asyncio
import operator
from functools import reduce
from typing import Any, AsyncIterator, Iterator

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.llms import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from .generation import TurboRAGParams
from .streaming import chunks_of, threaded_chunks


class TurboRAGLLM(TurboRAGParams, BaseLLM):
    """Text completion over a TurboRAGEngine; `generation_info["turborag"]` holds the stats."""

    @property
    def _llm_type(self) -> str:
        return "turborag-llm"

    def _last_chunk(self, result) -> GenerationChunk:
        stats = result.stats
        return GenerationChunk(text="", generation_info={
            "finish_reason": stats.finish_reason, **self.response_metadata(stats),
            "usage_metadata": self.usage_metadata(stats)})

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        return chunks_of(self.start(prompt, stop, kwargs),
                         lambda delta: GenerationChunk(text=delta), self._last_chunk, run_manager)

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> LLMResult:
        generations = []
        for prompt in prompts:
            merged = reduce(operator.add, self._stream(prompt, stop, run_manager, **kwargs))
            generations.append([Generation(text=merged.text,
                                           generation_info=merged.generation_info)])
        return LLMResult(generations=generations)

    def _astream(self, prompt: str, stop: list[str] | None = None,
                 run_manager: AsyncCallbackManagerForLLMRun | None = None,
                 **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        return threaded_chunks(lambda: self._stream(prompt, stop, None, **kwargs), run_manager)

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> LLMResult:
        return await asyncio.to_thread(self._generate, prompts, stop, None, **kwargs)
