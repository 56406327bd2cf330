"""TurboRAGLLM: a LlamaIndex LLM whose prompts reuse the stored KV blobs of retrieved chunks.

    llm = TurboRAGLLM(max_new_tokens=128)                    # bundled SmolLM2
    engine = index.as_query_engine(llm=llm, node_postprocessors=[llm.postprocessor()])

The stock query and chat engines build the prompt; this class renders it (chat template), asks
the shared ChunkRegistry which retrieved chunk texts it contains, and hands both to the engine,
which stitches their blobs and prefills the rest. Every response carries the call's cost in
`additional_kwargs["turborag"]` (on the last chunk when streaming).
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import ChatMessage, LLMMetadata, MessageRole
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.llm import default_completion_to_prompt

from ..core.engine import TurboRAGEngine
from ..core.config import EngineConfig
from ..core.models import DEFAULT_MODEL, ModelConfig
from ..core.prefill.anchor import CONTEXT_MARKER, VALUE_MARKER
from ..core.registry import ChunkRegistry
from ..core.request import Request
from ..core.run import GenerationResult, GenerationStream
from ..core.shared import shared_engine
from .base import StreamingLLM
from .wiring import EngineBound
from ..core.prompt_template import render_chat

STATS_KEY = "turborag"
_ROLES = {MessageRole.CHATBOT: "assistant", MessageRole.MODEL: "assistant",
          MessageRole.DEVELOPER: "system"}


def stats_payload(result: GenerationResult) -> dict:
    """What one call cost, as put in `additional_kwargs["turborag"]`."""
    s = result.stats
    return {"ttft_s": s.ttft_s, "reused_tokens": s.reused_tokens,
            "prefilled_tokens": s.prefilled_tokens, "cache_hits": s.cache_hits,
            "cache_misses": s.cache_misses, "prompt_tokens": s.prompt_tokens,
            "new_tokens": s.new_tokens, "finish_reason": s.finish_reason, "mode": s.mode,
            "lead_blob": bool(s.extra.get("lead_blob")),
            **{k: s.extra[k] for k in ("recovery", "recomputed_tokens", "recovery_s")
               if k in s.extra}}


class TurboRAGLLM(EngineBound, StreamingLLM):
    """A local causal LM served by a TurboRAGEngine.

    Give `engine=` to share one engine (its model and KV store) with the vector store and the
    postprocessor. Without one, the LLM takes the process's shared engine of `model_name`
    (core/shared.py: the one every adapter built without an engine takes), or, when it asks for
    its own `store_path`, anchor, encoder or context, loads its own. `mode="naive"` makes the
    same LLM prefill everything: the baseline to compare TTFT against.
    """

    stats_key: ClassVar[str] = STATS_KEY
    config_fields: ClassVar[tuple[str, ...]] = StreamingLLM.config_fields + ("quantize", "draft")

    model_name: str = Field(default=DEFAULT_MODEL,
                            description="bundled model name, local folder or Hugging Face id")
    store_path: Optional[str] = Field(default=None, description="KV store folder (None: default)")
    device: str = Field(default="cpu", description="where the model runs when no engine is "
                        "given: cpu, cuda, cuda:N, mps or auto (the first accelerator there is)")
    dtype: str = Field(default="float32", description="the weights' and blobs' dtype when no "
                       "engine is given: float32, bfloat16, float16 or auto (the checkpoint's)")
    mode: str = Field(default="turbo", description="'turbo' (reuse blobs) or 'naive' (prefill all)")
    recovery: Optional[str] = Field(default=None, description="turbo mode only: which chunk "
                                    "tokens to recompute with full context at query time; None: "
                                    "the engine's default ('select:0.15', the tokens the "
                                    "question attends to most), 'none': the blobs as they are "
                                    "(docs/accuracy.md)")
    quantize: Optional[str] = Field(default=None, description="decode with 'int8' or 'bf16' "
                                    "weights: faster, answers may drift (see GenerationConfig)")
    draft: Optional[str] = Field(default=None, description="'int8' or 'bf16' drafts verified in "
                                 "full precision: the full-precision answers (GenerationConfig)")
    context_window: Optional[int] = Field(default=None,
                                          description="None: the model's own window")
    anchor: Optional[str] = Field(default=None, description="what chunks are encoded after: chat "
                                  "| bos | none | a text (core/prefill/anchor.py); None: the "
                                  "engine's default (chat); used when no engine is given")
    model_kwargs: dict = Field(default_factory=dict, description="passed on to transformers' "
                               "from_pretrained when no engine is given (e.g. {'device_map': "
                               "'auto'}; core/models.py ModelConfig)")
    tokenizer_kwargs: dict = Field(default_factory=dict, description="passed on to the "
                                   "tokenizer's from_pretrained when no engine is given")
    encoder: Optional[str] = Field(default="default", description="learned chunk encoding: "
                                   "'default' (shipped for the bundled model), None, or a file; "
                                   "used when no engine is given")
    context_tokens: Optional[int] = Field(default=None, ge=0, description="chunks are encoded "
                                          "after up to this many tokens of their document's text "
                                          "before them (docs/concepts.md#context-encoding); None: "
                                          "the engine's default; used when no engine is given")
    namespace: Optional[str] = Field(default=None, description="the store namespace (a tenant) "
                                     "blobs are read from and written to: the engine's view "
                                     "engine.namespaced(namespace); None: the engine's own")
    check_fingerprint: bool = Field(default=True, description="raise FingerprintMismatch when "
                                    "the prompt holds chunks registered for another model")
    stock_head: bool = Field(default=True, description="encode chunks also right after the "
                             "prompt head of the query engines' default text QA template, so "
                             "that the chunk they put first is stitched exactly as a full "
                             "prefill computes it (one more blob per chunk; `add_prompt` for "
                             "other templates)")

    _engine: TurboRAGEngine = PrivateAttr()
    _registry: ChunkRegistry = PrivateAttr()

    def __init__(self, engine: TurboRAGEngine | None = None,
                 registry: ChunkRegistry | None = None, **kwargs: Any):
        if engine is not None:
            kwargs.setdefault("model_name", engine.loaded.name)
        super().__init__(**kwargs)
        Request("", mode=self.mode, recovery=self.recovery)  # a bad one fails now (checked there)
        if engine is None:
            # checked as it is made: a bad device or dtype fails before any load
            loading = ModelConfig(device=self.device, dtype=self.dtype,
                                  model_kwargs=self.model_kwargs,
                                  tokenizer_kwargs=self.tokenizer_kwargs)
            own = {name: getattr(self, name) for name in ("anchor", "context_tokens")
                   if getattr(self, name) is not None}  # None: the engine's default
            if self.encoder != "default":
                own["encoder"] = self.encoder
            if own or self.store_path is not None:  # its own store or encoding: its own engine
                engine = TurboRAGEngine(self.model_name, store=self.store_path,
                                        config=EngineConfig(model=loading), **own)
            else:  # the process's engine of this model, shared with other adapters
                engine = shared_engine(self.model_name, loading)
        self._bind(engine, registry, self.namespace)
        if self.context_window is None:
            self.context_window = engine.context_window
        if self.stock_head:
            from llama_index.core.prompts.default_prompt_selectors import \
                DEFAULT_TEXT_QA_PROMPT_SEL

            self.add_prompt(DEFAULT_TEXT_QA_PROMPT_SEL)

    @classmethod
    def class_name(cls) -> str:
        return "TurboRAGLLM"

    # ---- wiring ---------------------------------------------------------------------------
    @property
    def last_stats(self) -> Optional[dict]:
        return stats_payload(self._last) if self._last is not None else None

    def postprocessor(self, **kwargs: Any):
        """A KVCachePostprocessor on this LLM's engine and registry."""
        from .postprocessor import KVCachePostprocessor

        return KVCachePostprocessor(self._engine, registry=self._registry, **kwargs)

    def baseline(self) -> "TurboRAGLLM":
        """The same LLM (same engine and settings) in naive mode: full prefill, nothing reused."""
        fields = self.model_dump(exclude={"callback_manager", "mode"})
        return TurboRAGLLM(self._engine, registry=self._registry, mode="naive",
                           messages_to_prompt=self.messages_to_prompt,
                           completion_to_prompt=self.completion_to_prompt, **fields)

    def tokenize(self, text: str) -> list[int]:
        """`text`'s token ids under the model's own tokenizer, offline. LlamaIndex packs prompts
        by `Settings.tokenizer`'s count (tiktoken's GPT encoding unless set): `Settings.tokenizer
        = llm.tokenize` makes it count as the model does."""
        return self._engine.tokenizer(text, add_special_tokens=False)["input_ids"]

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.context_window, num_output=self.max_new_tokens,
                           model_name=self.model_name, is_chat_model=True)

    # ---- prompts --------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[ChatMessage]) -> str:
        """The prompt text of `messages`: a custom `messages_to_prompt`, else the chat template."""
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return self.messages_to_prompt(messages)
        return render_chat(self._engine.tokenizer,
            [{"role": _ROLES.get(m.role, m.role.value), "content": m.content or ""}
             for m in messages])

    def completion_prompt(self, prompt: str, formatted: bool = False) -> str:
        """A bare completion prompt goes through the chat template as one user turn."""
        if formatted:
            return prompt
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt)
        messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
        if self.system_prompt:
            messages.insert(0, ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt))
        return self.chat_prompt(messages)

    def add_prompt(self, template, context_key: str = "context_str") -> str:
        """Encode chunks also right after the head of `template` (a LlamaIndex prompt template
        whose `context_key` takes the retrieved chunks), as this LLM renders it; returns that
        head. The first chunk of a prompt made from the template is then stitched from that
        blob, exactly as a full prefill computes it (core/library.py, lead blobs). Chunks
        ingested before get theirs when a prompt first needs it."""
        values = {v: VALUE_MARKER for v in template.template_vars if v != context_key}
        if context_key not in template.template_vars:
            raise ValueError(f"the template has no {{{context_key}}} for the retrieved chunks "
                             f"(it takes {sorted(template.template_vars)}): name the one that "
                             "does as context_key")
        values[context_key] = CONTEXT_MARKER
        if self.metadata.is_chat_model:
            rendered = self.chat_prompt(template.format_messages(llm=self, **values))
        else:
            rendered = self.completion_prompt(template.format(llm=self, **values))
        return self._engine.add_prompt(rendered)

    # ---- generation -----------------------------------------------------------------------
    def chunks_in(self, prompt: str) -> list[str]:
        """The registered chunk texts `prompt` contains verbatim: the blobs to stitch.

        With `check_fingerprint`, a chunk registered only for another model raises
        FingerprintMismatch (a store built for another model is a mistake worth naming).
        """
        return self._registry.found_in(
            prompt, fingerprint=self._engine.fingerprint if self.check_fingerprint else None)

    def open_stream(self, prompt: str, kwargs: dict) -> GenerationStream:
        chunks = self.chunks_in(prompt) if self.mode == "turbo" else []
        return self._engine.stream(prompt, chunks=chunks, config=self.generation_config(kwargs),
                                   mode=self.mode, recovery=self.recovery)

    def _stats(self, result: GenerationResult) -> dict:
        return stats_payload(result)
