"""TurboRAGLLM: a LlamaIndex LLM whose prompts reuse the stored KV blobs of retrieved chunks.

    llm = TurboRAGLLM(max_new_tokens=128)                    # bundled SmolLM2
    engine = index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()])

The stock query and chat engines build the prompt; this class renders it (chat template), asks
the shared ChunkRegistry which retrieved chunk texts it contains, and hands both to the engine,
which stitches their blobs and prefills the rest. Every response carries the call's cost in
`additional_kwargs["turborag"]` (on the last chunk when streaming).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Iterator, List, Optional, Sequence

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseAsyncGen,
                                              ChatResponseGen, CompletionResponse,
                                              CompletionResponseAsyncGen, CompletionResponseGen,
                                              LLMMetadata, MessageRole)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt

from ..core.engine import MODES, GenerationResult, TurboRAGEngine
from ..core.generate import GenerationConfig
from ..core.models import DEFAULT_MODEL
from ..core.stitch import POSITION_MODES
from .registry import ChunkRegistry

STATS_KEY = "turborag"
_CONFIG_KWARGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "quantize",
                  "draft")
_ROLES = {MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
          MessageRole.DEVELOPER: "system"}


def stats_payload(result: GenerationResult) -> dict:
    """What one call cost, as put in `additional_kwargs["turborag"]`."""
    s = result.stats
    return {"ttft_s": s.ttft_s, "reused_tokens": s.reused_tokens,
            "prefilled_tokens": s.prefilled_tokens, "cache_hits": s.cache_hits,
            "cache_misses": s.cache_misses, "prompt_tokens": s.prompt_tokens,
            "new_tokens": s.new_tokens, "finish_reason": s.finish_reason, "mode": s.mode}


def config_from(llm: Any, kwargs: dict, names: Sequence[str]) -> GenerationConfig:
    """A GenerationConfig from the LLM's fields `names`, overridden by per-call kwargs."""
    values = {name: kwargs.get(name, getattr(llm, name)) for name in names}
    if "max_tokens" in kwargs:  # the OpenAI-style name some callers use
        values["max_new_tokens"] = kwargs["max_tokens"]
    return GenerationConfig(**values)


class TurboRAGLLM(CustomLLM):
    """A local causal LM served by a TurboRAGEngine.

    Give `engine=` to share one engine (its model and KV store) with the vector store and the
    postprocessor; otherwise one is loaded from `model_name` and `store_path`. `mode="naive"`
    makes the same LLM prefill everything: the baseline to compare TTFT against.
    """

    model_name: str = Field(default=DEFAULT_MODEL,
                            description="bundled model name, local folder or Hugging Face id")
    store_path: Optional[str] = Field(default=None, description="KV store folder (None: default)")
    positions: Optional[str] = Field(default=None,
                                     description="'reordered' or 'composite' (None: the engine's)")
    mode: str = Field(default="turbo", description="'turbo' (reuse blobs) or 'naive' (prefill all)")
    max_new_tokens: int = Field(default=256, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: Optional[int] = None
    stop: List[str] = Field(default_factory=list)
    quantize: Optional[str] = Field(default=None, description="decode with 'int8' or 'bf16' "
                                    "weights: faster, answers may drift (see GenerationConfig)")
    draft: Optional[str] = Field(default=None, description="'int8' or 'bf16' drafts verified in "
                                 "full precision: the full-precision answers (GenerationConfig)")
    context_window: Optional[int] = Field(default=None,
                                          description="None: the model's own window")
    anchor: str = Field(default="chat", description="what chunks are encoded after: chat | bos "
                        "| none | a text (core/anchor.py); used when no engine is given")
    adapter: Optional[str] = Field(default="default", description="LoRA adapter merged at load: "
                                   "'default' (shipped for the bundled model), None, or a file; "
                                   "used when no engine is given")

    _engine: TurboRAGEngine = PrivateAttr()
    _registry: ChunkRegistry = PrivateAttr()
    _last: Optional[GenerationResult] = PrivateAttr(default=None)

    def __init__(self, engine: TurboRAGEngine | None = None,
                 registry: ChunkRegistry | None = None, **kwargs: Any):
        if engine is not None:
            kwargs.setdefault("model_name", engine.loaded.name)
        super().__init__(**kwargs)
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.positions is not None and self.positions not in POSITION_MODES:
            raise ValueError(f"positions must be one of {POSITION_MODES}, not {self.positions!r}")
        if engine is None:
            engine = TurboRAGEngine(self.model_name, store=self.store_path,
                                    positions=self.positions or "reordered",
                                    anchor=self.anchor, adapter=self.adapter)
        self._engine = engine
        self._registry = registry if registry is not None else ChunkRegistry.for_engine(engine)
        if self.context_window is None:
            self.context_window = engine.context_window

    @classmethod
    def class_name(cls) -> str:
        return "TurboRAGLLM"

    # ---- wiring ---------------------------------------------------------------------------
    @property
    def engine(self) -> TurboRAGEngine:
        return self._engine

    @property
    def registry(self) -> ChunkRegistry:
        return self._registry

    @property
    def last_result(self) -> Optional[GenerationResult]:
        """The last finished generation (text, token ids, stats) of this LLM object."""
        return self._last

    @property
    def last_stats(self) -> Optional[dict]:
        return stats_payload(self._last) if self._last is not None else None

    def postprocessor(self, **kwargs: Any):
        """A KVCachePostprocessor on this LLM's engine and registry."""
        from .postprocessor import KVCachePostprocessor

        return KVCachePostprocessor(self._engine, registry=self._registry, **kwargs)

    def baseline(self) -> "TurboRAGLLM":
        """The same LLM (same engine and settings) in naive mode: full prefill, nothing reused."""
        fields = self.model_dump(exclude={"callback_manager", "mode"})
        return TurboRAGLLM(self._engine, registry=self._registry, mode="naive",
                           messages_to_prompt=self.messages_to_prompt,
                           completion_to_prompt=self.completion_to_prompt, **fields)

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window, num_output=self.max_new_tokens,
                           model_name=self.model_name, is_chat_model=True)

    # ---- prompts --------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text of `messages`: a custom `messages_to_prompt`, else the chat template."""
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self.messages_to_prompt(messages)
        return self._engine.render_chat(
            [{"role": _ROLES.get(m.role, m.role.value), "content": m.content or ""}
             for m in messages])

    def completion_prompt(self, prompt: str, formatted: bool = False) -> str:
        """A bare completion prompt goes through the chat template as one user turn."""
        if formatted:
            return prompt
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt)
        messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
        if self.system_prompt:
            messages.insert(0, ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt))
        return self.chat_prompt(messages)

    def _config(self, kwargs: dict) -> GenerationConfig:
        return config_from(self, kwargs, _CONFIG_KWARGS)

    # ---- generation -----------------------------------------------------------------------
    def _generate(self, prompt: str, **kwargs: Any) -> Iterator[CompletionResponse]:
        """Deltas as CompletionResponses, then a last one (empty delta) carrying the stats."""
        stream = self._engine.stream(prompt, chunks=self._registry.found_in(prompt),
                                     config=self._config(kwargs), mode=self.mode,
                                     positions=self.positions)
        text = ""
        for delta in stream:
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        result = stream.result
        self._last = result
        yield CompletionResponse(text=result.text, delta="",
                                 additional_kwargs={STATS_KEY: stats_payload(result)})

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
    # prefills and decodes; streams hop to the thread once per token.
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, self.completion_prompt(prompt, formatted),
                                       **kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        return _in_thread(self._generate(self.completion_prompt(prompt, formatted), **kwargs))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = await asyncio.to_thread(self._complete, self.chat_prompt(messages), **kwargs)
        return self._as_chat(response)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        return _in_thread(self._chat_stream(self.chat_prompt(messages), **kwargs))


async def _in_thread(iterator: Iterator) -> AsyncIterator:
    """Drive a blocking iterator from a worker thread, one item at a time."""
    done = object()
    try:
        while True:
            item = await asyncio.to_thread(next, iterator, done)
            if item is done:
                return
            yield item
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            await asyncio.to_thread(close)
