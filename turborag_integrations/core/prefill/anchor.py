"""The anchor a chunk is encoded after: which text, as token ids.

TurboRAG encodes every chunk alone at positions 0..n−1, so each chunk's first token plays the
start of a sequence: the model parks attention on it (an attention sink), and a stitched prompt
then carries one spurious sink per chunk. Encoding each chunk after a fixed anchor and keeping
only the chunk's own KV removes that, at no query-time cost (the anchor is known at ingestion and
its KV is discarded). The choices:

- "chat"  — the model's chat-template head with a generic system prompt, up to where a user
  message starts (APE encodes every context after the same BOS + chat header). Models without a
  chat template fall back to "bos".
- "bos"   — the beginning-of-sequence token alone (the sink), where the tokenizer has one.
- "none"  — no anchor: the paper's encoding at positions 0..n−1.
- any other string — that exact text, e.g. an app's own prompt head, so that a chunk placed
  right after that head is encoded exactly as a full prefill would compute it.
"""

from __future__ import annotations

ANCHORS = ("chat", "bos", "none")
DEFAULT_ANCHOR = "chat"
GENERIC_SYSTEM = "You are a helpful assistant."
_SENTINEL = "\x00TURBORAG-ANCHOR\x00"
# Where the retrieved chunks go when an adapter renders its template to find its prompt head
# (`PromptAssembly.prompt_head`): text no template or document holds.
CONTEXT_MARKER = "\x00TURBORAG-CONTEXT\x00"
# ...and what the template's other variables (the question) are rendered as.
VALUE_MARKER = "\x00TURBORAG-VALUE\x00"


def chat_head(tokenizer, system: str = GENERIC_SYSTEM) -> str:
    """The chat template's text before a user message's content ("" without a template)."""
    if not getattr(tokenizer, "chat_template", None):
        return ""
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": _SENTINEL}],
        tokenize=False, add_generation_prompt=False)
    head, found, _ = text.partition(_SENTINEL)
    return head if found else ""


def anchor_text(spec: str | None, tokenizer) -> str:
    """The anchor text for a spec (see the module docstring); "" means no anchor."""
    if spec is None or spec == "none":
        return ""
    if spec == "chat":
        return chat_head(tokenizer) or anchor_text("bos", tokenizer)
    if spec == "bos":
        return getattr(tokenizer, "bos_token", None) or ""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"anchor must be one of {ANCHORS} or a non-empty text, not {spec!r}")
    return spec


def anchor_ids(spec: str | None, tokenizer) -> list[int]:
    text = anchor_text(spec, tokenizer)
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
