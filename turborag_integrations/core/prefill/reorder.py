"""Question-first prompts, turned so that the question follows the chunks.

A stitched chunk never sees the text before it, so in TurboRAG the model reads the retrieved
chunks without knowing the question, and everything it learns about them for this question is
computed by the tokens *after* the chunks. With a context-first template ("Context: … Question:
… Answer:", LlamaIndex's defaults) those are the question's tokens, attending to every chunk.
With a question-first template (LangChain's common RAG prompt: "… Question: {question}
Context: {context} Answer:") only a few tokens such as "Answer:" come after the chunks, and a
small model answers from the wrong chunk: on the dev set the stock LangChain chain answered 1 of
30 questions stitched against 13 of 30 with a full prefill.

`question_last` moves the chunks in front of the user's text that precedes them, inside the
same turn: the chat template's head (system prompt and the user-turn opener) stays first, then
the chunks, then the user's text, then whatever followed the chunks. The prompt then has the
layout TurboRAG was made for. It is a change of the prompt, so the
engine does it only where asked (`TurboRAGEngine(question_last=True)`) and only in turbo mode:
a full prefill keeps the prompt as written, its chunks already see the question.
"""

from __future__ import annotations

from typing import Iterable

from .segment import find_chunks

_PROBE_SYSTEM = "\x00system\x00"
_PROBE_USER = "\x00user\x00"


def user_turn_opener(tokenizer) -> str | None:
    """The text a chat template puts between a system message and the user's text (for ChatML
    "<|im_end|>\\n<|im_start|>user\\n"): where the user's own text of a rendered prompt starts.
    None without a chat template, or one that does not take a system message."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "system", "content": _PROBE_SYSTEM},
             {"role": "user", "content": _PROBE_USER}], tokenize=False,
            add_generation_prompt=False)
    except Exception:  # templates that refuse a system role (some raise from Jinja)
        return None
    start, end = text.find(_PROBE_SYSTEM), text.find(_PROBE_USER)
    if start < 0 or end < start:
        return None
    opener = text[start + len(_PROBE_SYSTEM): end]
    return opener or None


def question_last(prompt: str, chunks: Iterable[str], opener: str | None) -> str:
    """`prompt` with its chunks moved in front of the user's text before them, where that text is
    longer than the user's text after them (a question-first prompt); else `prompt` unchanged.

    The user's text before the chunks starts after the last `opener` (all the text before them
    where `opener` is None or absent: a plain prompt); after the chunks it runs to the end of the
    turn (`turn_end`). The moved text keeps its characters, trailing whitespace aside, and is set
    off from the chunks by a blank line.
    """
    matches = find_chunks(prompt, chunks)
    if not matches:
        return prompt
    first, last = matches[0][0], matches[-1][1]
    head = prompt[:first]
    cut = head.rfind(opener) + len(opener) if opener and opener in head else 0
    before, after = head[cut:], prompt[last:]
    if not before.strip() or len(before.strip()) <= len(_user_part(after, opener).strip()):
        return prompt
    return head[:cut] + prompt[first:last] + "\n\n" + before.rstrip() + after


def turn_end(opener: str | None) -> str | None:
    """What ends a turn in a template whose user-turn opener is `opener`: the opener up to its
    role name (ChatML: "<|im_end|>\n<|im_start|>"), which also starts the assistant's turn."""
    if not opener or "user" not in opener:
        return None
    return opener[: opener.index("user")] or None


def _user_part(after: str, opener: str | None) -> str:
    end = turn_end(opener)
    return after[: after.index(end)] if end and end in after else after
