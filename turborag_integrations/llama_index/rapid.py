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

from typing import Any, ClassVar, Optional, Sequence

from llama_index.core.base.llms.types import ChatMessage, LLMMetadata, MessageRole
from llama_index.core.bridge.pydantic import Field, PrivateAttr

from ..core.rapid import RapidEngine, RapidResult, split_question
from ..core.run import GenerationStream
from .base import StreamingLLM

STATS_KEY = "rapid"


def _texts(chunks: Any) -> list[str]:
    out = []
    for c in chunks:
        node = getattr(c, "node", c)  # NodeWithScore → node
        out.append(node.get_content() if hasattr(node, "get_content") else str(node))
    return out


class RapidLLM(StreamingLLM):
    """Long-context answers by retrieval-augmented speculative decoding. See the module doc."""

    stats_key: ClassVar[str] = STATS_KEY

    gamma: Optional[int] = Field(default=None, description="drafts per round (None: engine's)")
    eta: Optional[float] = Field(default=None, description="augmentation weight (None: engine's)")

    _rapid: RapidEngine = PrivateAttr()
    _retriever: Any = PrivateAttr(default=None)

    def __init__(self, rapid: RapidEngine, retriever: Any = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._rapid = rapid
        self._retriever = retriever

    @classmethod
    def class_name(cls) -> str:
        return "RapidLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self._rapid.target.context_window,
                           num_output=self.max_new_tokens,
                           model_name=self._rapid.target.loaded.name, is_chat_model=False)

    @property
    def rapid(self) -> RapidEngine:
        return self._rapid

    def _drafter_chunks(self, question: str, kwargs: dict) -> Optional[list[str]]:
        """`chunks=` of the call, else what the retriever returns for the question, as
        retrieved (the engine puts them in document order); None: the engine retrieves."""
        if kwargs.get("chunks") is not None:
            return _texts(kwargs["chunks"])
        if self._retriever is not None:
            return _texts(self._retriever.retrieve(question))
        return None

    def open_stream(self, prompt: str, kwargs: dict) -> GenerationStream:
        context, question = split_question(prompt)
        return self._rapid.stream(context, question,
                                  chunks=self._drafter_chunks(question, kwargs),
                                  config=self.generation_config(kwargs), gamma=self.gamma,
                                  eta=self.eta)

    def _stats(self, result: RapidResult) -> dict:
        return result.stats.as_dict()

    @staticmethod
    def chat_prompt(messages: Sequence[ChatMessage]) -> str:
        """Single-turn QA: the last user message is the prompt; earlier turns join the context."""
        texts = [m.content or "" for m in messages if m.role != MessageRole.SYSTEM]
        return "\n\n".join(t for t in texts if t)
