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

from typing import Any

from langchain_core.messages import BaseMessage
from pydantic import ConfigDict, Field

from ..core.rapid import RapidEngine, RapidStats, split_question
from ..core.run import GenerationStream
from .generation import SAMPLING_KWARGS, SamplingParams, call_kwargs, chunk_texts
from .streaming import StreamingChatModel

_CALL_KWARGS = SAMPLING_KWARGS | {"chunks", "gamma", "eta"}


class RapidChatModel(SamplingParams, StreamingChatModel):
    """Chat model over a RapidEngine. See the module docstring."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rapid: RapidEngine = Field(exclude=True)
    retriever: Any = Field(default=None, exclude=True)
    """A LangChain retriever for the drafter's chunks (None: the engine's own retrieval)."""
    gamma: int | None = None
    eta: float | None = None

    @property
    def _llm_type(self) -> str:
        return "turborag-rapid-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model_name": self.rapid.target.loaded.name,
                "drafter": self.rapid.drafter.loaded.name, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "gamma": self.gamma or self.rapid.config.speculation.gamma,
                "eta": self.eta if self.eta is not None
                else self.rapid.config.speculation.eta}

    @staticmethod
    def prompt_of(messages: list[BaseMessage]) -> str:
        return "\n\n".join(m.text for m in messages if m.type != "system" and m.text)

    def open_stream(self, messages: list[BaseMessage], stop: list[str] | None,
                    kwargs: dict) -> GenerationStream:
        call = call_kwargs(self, kwargs, _CALL_KWARGS)
        context, question = split_question(self.prompt_of(messages))
        # The drafter's chunks go to the engine as retrieved: it puts them in document order.
        chunks = call.get("chunks")
        if chunks is None and self.retriever is not None:
            chunks = self.retriever.invoke(question)
        return self.rapid.stream(context, question,
                                 chunks=chunk_texts(chunks) if chunks is not None else None,
                                 config=self.generation_config(stop, call),
                                 gamma=call.get("gamma", self.gamma),
                                 eta=call.get("eta", self.eta))

    def response_metadata(self, stats: RapidStats) -> dict:
        return {"model_name": self.rapid.target.loaded.name, "model_provider": "turborag",
                "finish_reason": stats.finish_reason, "rapid": stats.as_dict()}

    def usage_metadata(self, stats: RapidStats) -> dict:
        return {"input_tokens": stats.target_prompt_tokens, "output_tokens": stats.new_tokens,
                "total_tokens": stats.target_prompt_tokens + stats.new_tokens,
                "input_token_details": {"cache_read": stats.target_reused_tokens}}
