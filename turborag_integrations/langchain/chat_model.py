"""TurboRAGChatModel: a LangChain chat model that reuses cached document KV inside its prompts.

The messages are rendered through the model's own chat template, then the engine looks for the
texts of known documents (the registry the vector store wrapper fills, plus any `chunks=`) in
the rendered prompt, stitches their stored KV blobs in, and prefills only the rest. Text it does
not find verbatim is prefilled like any other text, so no prompt text can make it fail; only
documents ingested for another model are refused (`FingerprintMismatch`, see
`check_fingerprint`).

    llm = TurboRAGChatModel(engine=engine)
    msg = llm.invoke(messages)
    msg.response_metadata["turborag"]["reused_tokens"]
"""

from __future__ import annotations

from langchain_core.messages import BaseMessage, ChatMessage

from ..core.run import GenerationStream
from .generation import TurboRAGParams
from .streaming import StreamingChatModel
from ..core.prompt_template import render_chat

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


class TurboRAGChatModel(TurboRAGParams, StreamingChatModel):
    """Chat model over a TurboRAGEngine. See the module docstring."""

    @property
    def _llm_type(self) -> str:
        return "turborag-chat"

    def render(self, messages: list[BaseMessage]) -> str:
        """The exact prompt text the model sees (chat template applied)."""
        return render_chat(self.get_engine().tokenizer, to_chat(messages))

    def render_prompt(self, value) -> str:
        return self.render(value.to_messages())

    def open_stream(self, messages: list[BaseMessage], stop: list[str] | None,
                    kwargs: dict) -> GenerationStream:
        return self.start(self.render(messages), stop, kwargs)
