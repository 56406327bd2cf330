"""The RAG prompt shared by evaluation and encoder training (they must build exactly the same
one)."""

from __future__ import annotations

from typing import Sequence

SYSTEM = ("Answer the question using only the context. Reply with the answer alone, in a few "
          "words.")
SEPARATOR = "\n\n"


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")


def build_prompt(tokenizer, question: str, chunks: Sequence[str], *,
                 system: str = SYSTEM) -> tuple[str, list[str]]:
    """(prompt text, chunk texts as they occur in it): the model's chat template with a system
    instruction, then the context (chunks joined by blank lines), then the question."""
    texts = list(chunks)
    user = "Context:\n" + SEPARATOR.join(texts) + f"{SEPARATOR}Question: {question}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return render(tokenizer, messages), texts


def prompt_head(tokenizer, system: str = SYSTEM) -> str:
    """The evaluation prompt's text before its first chunk: the same for every question, so an
    app that knows its template at ingestion can encode chunks after exactly this."""
    marker = "\x00CHUNK\x00"
    prompt, _ = build_prompt(tokenizer, "?", [marker], system=system)
    return prompt.partition(marker)[0]
