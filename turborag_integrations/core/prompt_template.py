"""An app's prompt template, given as a file, rendered as the engine needs it to find its head.

A server's clients send finished prompts: which text comes before the retrieved chunks is known
only to the app that built them. An operator who knows it names the app's template in a file,
and the engine encodes every chunk once more after that head (lead blobs, core/library.py):

- a chat, as JSON: a list of OpenAI-style messages, `[{"role": "system", "content": "…"},
  {"role": "user", "content": "Context:\\n{context}\\n\\nQuestion: {question}"}]`, rendered
  through the model's chat template as the server renders a request;
- a text prompt (any other file), used as it is, as /v1/completions receives it.

`{context}` marks where the chunks go; any other `{name}` is a value that changes per request
(it may not come before the chunks, or the head would change with it); `{{` and `}}` are
literal braces, as in Python's `str.format`.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Sequence

from .prefill.anchor import CONTEXT_MARKER, VALUE_MARKER

CONTEXT_FIELD = "context"
Template = str | list[dict]


def render_chat(tokenizer, messages: Sequence[dict], *,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat, through the model's own chat template (`tokenizer`'s)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    # No template (base models): plain "role: content" lines.
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")


def read_prompt_template(path: str | Path) -> Template:
    """The template in `path`: a list of chat messages (a .json file) or prompt text. Raises
    ValueError naming the file and what is wrong (checked before any model is loaded)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the prompt template {path}: {exc.strerror or exc}") from None
    template: Template = text
    if path.suffix.lower() == ".json":
        try:
            template = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc.msg}, line {exc.lineno}): a .json prompt "
                             "template is a list of chat messages") from None
        if not (isinstance(template, list) and template and all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) for m in template)):
            raise ValueError(f"{path}: a .json prompt template is a list of chat messages, each "
                             '{"role": …, "content": …} with text content')
    fields = {f for part in _texts(template) for f in _fields(part, path)}
    if CONTEXT_FIELD not in fields:
        raise ValueError(f"{path}: the template has no {{{CONTEXT_FIELD}}} where the retrieved "
                         "chunks go" + (f" (it has {', '.join(sorted(fields))})" if fields else ""))
    return template


def render_prompt_template(template: Template, tokenizer) -> str:
    """The template rendered with CONTEXT_MARKER for {context} and VALUE_MARKER for every other
    field, chats through `tokenizer`'s chat template: what `TurboRAGEngine.add_prompt` takes."""
    values = _Markers()
    if isinstance(template, str):
        return string.Formatter().vformat(template, (), values)
    return render_chat(tokenizer, [{**m, "content": string.Formatter().vformat(
        m["content"], (), values)} for m in template])


class _Markers(dict):
    def __missing__(self, key: str) -> str:
        return CONTEXT_MARKER if key == CONTEXT_FIELD else VALUE_MARKER


def _texts(template: Template) -> list[str]:
    return [template] if isinstance(template, str) else [m["content"] for m in template]


def _fields(text: str, path: Path) -> list[str]:
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc} (write a literal brace as {{{{ or }}}})") from None
    for name in names:
        if not name.isidentifier():
            raise ValueError(f"{path}: {{{name}}} is not a field name: name each field, as in "
                             f"{{{CONTEXT_FIELD}}} or {{question}}")
    return names
