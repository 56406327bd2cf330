"""A callback handler that keeps what a chain run retrieved and what the model reported.

A chain that ends in `StrOutputParser` returns plain text, so the `response_metadata` with the
TurboRAG stats never reaches the caller. This handler picks them up on the way.

    run = TurboRAGRunCollector()
    for text in chain.stream(question, config={"callbacks": [run]}):
        print(text, end="")
    run.stats["ttft_s"], run.stats["reused_tokens"], [d.metadata for d in run.documents]
"""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.outputs import LLMResult


class TurboRAGRunCollector(BaseCallbackHandler):
    """Collects the last retrieval's documents and the last model call's TurboRAG stats."""

    def __init__(self) -> None:
        self.documents: list[Document] = []
        self.stats: dict[str, Any] = {}

    def on_retriever_end(self, documents, **kwargs: Any) -> None:
        self.documents = list(documents)

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        for generations in response.generations:
            for generation in generations:
                message = getattr(generation, "message", None)
                metadata = (message.response_metadata if message is not None
                            else generation.generation_info or {})
                if "turborag" in metadata:
                    self.stats = dict(metadata["turborag"])
