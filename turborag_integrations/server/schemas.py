"""The request bodies the server accepts: OpenAI's completions and chat completions, and the
ingestion of chunk texts.

Fields of newer API versions that a client may send are accepted and ignored (`extra="allow"`),
unless they ask for something this server cannot do; then `refusal()` names the field, so that
the client gets a 400 instead of a silently different answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..core.request import Request

# vLLM's rules for a cache salt (vllm/entrypoints/generate/base/protocol.py), so that a salt a
# client uses with this server is one vLLM takes too
MAX_CACHE_SALT_CHARS = 128
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\x00")


def check_cache_salt(salt: str | None) -> str | None:
    if salt is None:
        return None
    if not salt:
        raise ValueError("cache_salt must be a non-empty string when it is given")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ValueError(f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters "
                         f"(got {len(salt)})")
    if any(c in salt for c in CACHE_SALT_FORBIDDEN):
        raise ValueError("cache_salt must not contain '@', '/', '\\' or NUL")
    return salt


# A round of RAPID holds the model (the batch waits for it): γ bounds how long.
MAX_RAPID_GAMMA = 32
RAPID_FORM = ('true, or an object of per-request overrides, {"gamma": an integer from 1 to '
              f'{MAX_RAPID_GAMMA}, "eta": a number ≥ 0}} (both optional)')


@dataclass(frozen=True)
class RapidOptions:
    """A RAPID request's overrides of the server's γ and η (None: the server's)."""

    gamma: int | None = None
    eta: float | None = None


def rapid_options(value: Any) -> RapidOptions | None:
    """`turborag_rapid` as sent: None for an ordinary request (absent, null or false)."""
    if value is None or value is False:
        return None
    if value is True:
        return RapidOptions()
    if isinstance(value, RapidOptions):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"turborag_rapid is {RAPID_FORM}")
    unknown = sorted(set(value) - {"gamma", "eta"})
    if unknown:
        raise ValueError(f"turborag_rapid takes gamma and eta, not {unknown[0]!r}")
    gamma, eta = value.get("gamma"), value.get("eta")
    if gamma is not None and (type(gamma) is not int or not 1 <= gamma <= MAX_RAPID_GAMMA):
        raise ValueError(f"turborag_rapid.gamma must be an integer from 1 to {MAX_RAPID_GAMMA}, "
                         f"not {gamma!r}")
    if eta is not None and (type(eta) not in (int, float) or not 0 <= eta < math.inf):
        raise ValueError(f"turborag_rapid.eta must be a finite number ≥ 0 (0: the target's own "
                         f"answer), not {eta!r}")
    return RapidOptions(gamma, None if eta is None else float(eta))


def _valid_unicode(value: Any) -> Any:
    """Refuse a text that UTF-8 cannot encode (an unpaired surrogate, which JSON's \\ud800
    escapes can carry): no tokenizer takes it."""
    texts = [value] if isinstance(value, str) else value if isinstance(value, list) else ()
    for text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"holds an unpaired surrogate ({text[exc.start]!r} at "
                                 f"character {exc.start}): send valid Unicode") from None
    return value


class Body(BaseModel):
    """Every field's text must be valid Unicode."""

    @field_validator("*")
    @classmethod
    def _unicode(cls, value: Any) -> Any:
        return _valid_unicode(value)


class Salted(Body):
    cache_salt: str | None = None
    """Splits the caller's cache further, as vLLM's field of the same name splits its prefix
    cache: blobs made or found for this request lie in the caller's namespace under this salt,
    apart from those of every other salt (and of none). vLLM's rules apply."""

    @field_validator("cache_salt")
    @classmethod
    def _salt(cls, value: str | None) -> str | None:
        return check_cache_salt(value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class CompletionParams(Salted):
    """What both completion endpoints accept."""

    model_config = ConfigDict(extra="allow")

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default is 1
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    """Decode max_tokens tokens past any end-of-sequence token (vLLM's extension): for
    benchmarks in which every request does the same work."""
    turborag_chunks: list[str] | None = None
    """Chunk texts to reuse besides those found in the prompt by content; those without a blob
    yet are encoded (and indexed for later requests) before the prompt is prefilled."""
    turborag_mode: Literal["turbo", "naive"] | None = None
    """"naive" prefills this prompt whole, reusing nothing (the baseline to compare with);
    unset: the server's mode (`turborag serve --mode`)."""
    turborag_recovery: str | None = None
    """Which chunk tokens a turbo prefill recomputes with full context: "select:0.15" (the
    tokens the question attends to most), "select:auto", "boundary:16", "none", …
    (core/prefill/recovery.py); unset: the server's (`turborag serve --recovery`)."""

    turborag_rapid: RapidOptions | None = None
    """Answer with RAPID (docs/rapid.md): true, or {"gamma": …, "eta": …} to override the
    server's for this request. Chat completions only, on a server started with
    `--rapid-drafter` (server/rapid.py says which messages it takes)."""

    @field_validator("turborag_recovery")
    @classmethod
    def _recovery(cls, value: str | None) -> str | None:
        Request("", recovery=value)  # a spec that does not parse: a 400 naming the accepted ones
        return value

    @field_validator("turborag_rapid", mode="before")
    @classmethod
    def _rapid(cls, value: Any) -> RapidOptions | None:
        return rapid_options(value)

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refusal(self) -> tuple[str, str] | None:
        """(param, message) of the first setting this server cannot honour; None if none."""
        if self.n not in (None, 1):
            return "n", "only n=1 is supported (one completion per request)"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported (send 0 or leave it out)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class TextPart(Body):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(Body):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None

    def text(self) -> str | None:
        """The message's text; None if it holds anything but text."""
        if isinstance(self.content, list):
            if any(part.type != "text" or part.text is None for part in self.content):
                return None
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(CompletionParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def refusal(self) -> tuple[str, str] | None:
        for name in ("tools", "functions"):
            if getattr(self, name):
                return name, f"{name} (function calling) are not supported"
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                return name, f"{name} is not supported (no function calling)"
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "only the text response format is supported"
        for i, message in enumerate(self.messages):
            if message.role in ("tool", "function") or message.tool_calls:
                return f"messages[{i}]", "tool and function messages are not supported"
            if message.text() is None:
                return f"messages[{i}].content", "only text content is supported"
        return super().refusal()

    def chat(self) -> list[dict]:
        """The messages as the chat template takes them (developer turns are system turns)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class CompletionRequest(CompletionParams):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for text completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refusal(self) -> tuple[str, str] | None:
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            return "prompt", "send one prompt per request (a string)"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.echo:
            return "echo", "echo is not supported"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if self.turborag_rapid is not None:
            return "turborag_rapid", ("RAPID answers chat completions only: send the request to "
                                      "/v1/chat/completions, its user message the context, a "
                                      "blank line, then the question")
        return super().refusal()

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChunksRequest(Salted):
    """The body of POST /v1/turborag/chunks."""

    model_config = ConfigDict(extra="forbid")

    texts: list[str] = Field(min_length=1)
    public: bool = False
    """Ingest into the shared public namespace, which every caller's prompts reuse (and can
    therefore detect), instead of the caller's own."""
    doc_id: str | None = None
    """A document the texts belong to: the store keeps their blobs while a document claims
    them (see `TurboRAGEngine.forget_document`)."""
    contexts: list[str | None] | None = None
    """The text before each text in its document (null for a document's first piece): a
    server whose engine has `context_tokens` encodes each chunk after the end of it."""
