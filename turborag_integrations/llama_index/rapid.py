"""RapidLLM: a LlamaIndex LLM that answers over a long context with RAPID.

    rapid = RapidEngine(TurboRAGEngine())                  # self-speculation on one model
    llm = RapidLLM(rapid, retriever=index.as_retriever(similarity_top_k=4))
    llm.complete(long_document + "\n\n" + question)

The prompt is the long context, a blank line, then the question. The target reads all of it (its
prefill is cached per context, so further questions on the same document prefill only the
question); the drafter reads the chunks the retriever returns for the question (or, with no
retriever, the engine's own retrieval over the context; or `chunks=` nodes/texts per call).
Stats ride in `additional_kwargs["rapid"]` (on the last chunk when streaming).
"""

from __future__ import annotations

from typing import Any, Iterator, List, Optional, Sequence

from llama_index.core.base.llms.types import (ChatMessage, ChatResponse, ChatResponseGen,
                                              CompletionResponse, CompletionResponseGen,
                                              LLMMetadata, MessageRole)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from ..core.generate import GenerationConfig
from ..core.rapid import RapidEngine, RapidResult, split_question
from .llm import config_from

STATS_KEY = "rapid"
_CONFIG_KWARGS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")


def _texts(chunks: Any) -> list[str]:
    out = []
    for c in chunks:
        node = getattr(c, "node", c)  # NodeWithScore → node
        out.append(node.get_content() if hasattr(node, "get_content") else str(node))
    return out


class RapidLLM(CustomLLM):
    """Long-context answers by retrieval-augmented speculative decoding. See the module doc."""

    max_new_tokens: int = Field(default=256, ge=0)
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    seed: Optional[int] = None
    stop: List[str] = Field(default_factory=list)
    gamma: Optional[int] = Field(default=None, description="drafts per round (None: engine's)")
    eta: Optional[float] = Field(default=None, description="augmentation weight (None: engine's)")

    _rapid: RapidEngine = PrivateAttr()
    _retriever: Any = PrivateAttr(default=None)
    _last: Optional[RapidResult] = PrivateAttr(default=None)

    def __init__(self, rapid: RapidEngine, retriever: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._rapid = rapid
        self._retriever = retriever

    @classmethod
    def class_name(cls) -> str:
        return "RapidLLM"

    @property
    def rapid(self) -> RapidEngine:
        return self._rapid

    @property
    def last_result(self) -> Optional[RapidResult]:
        return self._last

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._rapid.target.context_window,
                           num_output=self.max_new_tokens,
                           model_name=self._rapid.target.loaded.name, is_chat_model=False)

    def _config(self, kwargs: dict) -> GenerationConfig:
        return config_from(self, kwargs, _CONFIG_KWARGS)

    def _drafter_chunks(self, context: str, question: str, kwargs: dict) -> Optional[list[str]]:
        if kwargs.get("chunks") is not None:
            return _texts(kwargs["chunks"])
        if self._retriever is not None:
            texts = _texts(self._retriever.retrieve(question))
            # Keep what the long context holds, in document order.
            found = [(context.find(t), t) for t in texts if t and t in context]
            return [t for _, t in sorted(found)] if found else texts
        return None

    def _generate(self, prompt: str, **kwargs: Any) -> Iterator[CompletionResponse]:
        context, question = split_question(prompt)
        stream = self._rapid.stream(context, question,
                                    chunks=self._drafter_chunks(context, question, kwargs),
                                    config=self._config(kwargs), gamma=self.gamma, eta=self.eta)
        text = ""
        for delta in stream:
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        self._last = stream.result
        yield CompletionResponse(text=stream.result.text, delta="",
                                 additional_kwargs={STATS_KEY: stream.result.stats.as_dict()})

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        last = None
        for last in self._generate(prompt, **kwargs):
            pass
        return last  # type: ignore[return-value]

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        return self._generate(prompt, **kwargs)

    @staticmethod
    def chat_prompt(messages: Sequence[ChatMessage]) -> str:
        """Single-turn QA: the last user message is the prompt; earlier turns join the context."""
        texts = [m.content or "" for m in messages if m.role != MessageRole.SYSTEM]
        return "\n\n".join(t for t in texts if t)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        r = self.complete(self.chat_prompt(messages), **kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text),
                            additional_kwargs=r.additional_kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        def gen():
            for r in self._generate(self.chat_prompt(messages), **kwargs):
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=r.text),
                                   delta=r.delta, additional_kwargs=r.additional_kwargs)
        return gen()
