"""What the TurboRAG LangChain models share: engine, sampling knobs, per-call arguments, lookup.

The chat model and the text-completion LLM end in the same call, `engine.stream(prompt,
chunks=...)`; they differ only in how the prompt is made (chat template or raw text) and in the
LangChain types they return. RapidChatModel shares the sampling knobs (`SamplingParams`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

from langchain_core.documents import Document
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from ..core.engine import TurboRAGEngine
from ..core.models import ModelConfig
from ..core.prefill.anchor import CONTEXT_MARKER, VALUE_MARKER
from ..core.registry import ChunkRegistry
from ..core.request import Request
from ..core.run import GenerationStats, GenerationStream
from ..core.shared import shared_engine
from ..core.settings import GenerationConfig
from .fingerprints import check_metadata

log = logging.getLogger(__name__)

# Keyword arguments LangChain itself may pass down to _generate/_stream; not ours to refuse.
_FRAMEWORK_KWARGS = {"stream", "ls_structured_output_format"}
SAMPLING_KWARGS = {"max_tokens", "temperature", "top_p", "top_k", "seed"}
_CALL_KWARGS = SAMPLING_KWARGS | {"mode", "chunks", "model", "encode_missing", "quantize", "draft",
                                  "recovery"}


@functools.lru_cache(maxsize=8)
def shared_tokenizer(model: str | None = None):
    """The tokenizer of a model by name, loaded once per process without its weights."""
    from ..core.models import load_tokenizer

    return load_tokenizer(model, progress=False)


def chunk_texts(chunks: Any) -> list[str]:
    """Texts from a str, a Document, or a list of either."""
    if chunks is None:
        return []
    if isinstance(chunks, (str, Document)):
        chunks = [chunks]
    return [c.page_content if isinstance(c, Document) else str(c) for c in chunks]


def call_kwargs(model: Any, kwargs: dict, accepted: set[str]) -> dict:
    """The per-call arguments of `kwargs` that `model` accepts; a TypeError names any other.

    LangChain's own arguments are let through and dropped."""
    unknown = set(kwargs) - accepted - _FRAMEWORK_KWARGS
    if unknown:
        raise TypeError(f"{type(model).__name__} got unsupported arguments {sorted(unknown)}; "
                        f"it accepts {sorted(accepted)} (tools and structured output are not "
                        "supported)")
    return {k: v for k, v in kwargs.items() if k in accepted}


class SamplingParams(BaseModel):
    """How tokens are picked: fields every TurboRAG LangChain model has, each overridable per
    call (`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`; `stop` as LangChain passes it)."""

    temperature: float = 0.0
    """0 is greedy decoding."""
    max_tokens: int = 256
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | None = None

    def decoding_options(self, call: dict) -> dict:
        """Further GenerationConfig settings of this model for one call (none here)."""
        return {}

    def generation_config(self, stop: list[str] | None, call: dict) -> GenerationConfig:
        """The GenerationConfig of one call: the fields, overridden by the call's arguments."""
        names = ("max_tokens", "temperature", "top_p", "top_k", "seed")
        return GenerationConfig.from_options(
            {name: getattr(self, name) for name in names}, {"stop": self.stop},
            {name: call[name] for name in names if name in call}, {"stop": stop},
            self.decoding_options(call))


class TurboRAGParams(SamplingParams):
    """Fields and helpers of the TurboRAG LangChain models."""

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True,
                              protected_namespaces=())

    engine: TurboRAGEngine | None = Field(default=None, exclude=True)
    """The engine (model + KV store). Share it with `KVCachingVectorStore` so both use one
    store. If not given, a shared engine for `model` is created on first use."""
    model_name: str | None = Field(default=None, alias="model")
    """Model to load when no engine is given (None: the bundled SmolLM2)."""
    device: str = "cpu"
    """Where that model runs: cpu, cuda, cuda:N, mps or auto (the first accelerator there is)."""
    dtype: str = "float32"
    """Its weights' and blobs' dtype: float32, bfloat16, float16 or auto (the checkpoint's)."""
    model_kwargs: dict = Field(default_factory=dict)
    """Passed on to transformers' `from_pretrained` when loading that model (e.g.
    `{"device_map": "auto"}`, `{"revision": ...}`; core/models.py `ModelConfig`)."""
    tokenizer_kwargs: dict = Field(default_factory=dict)
    """Passed on to the tokenizer's `from_pretrained`."""
    mode: Literal["turbo", "naive"] = "turbo"
    """"turbo" reuses cached document KV; "naive" prefills everything (the baseline)."""
    recovery: str | None = None
    """Turbo mode only: which chunk tokens to recompute with full context at query time. None:
    the engine's default ("select:0.15", the tokens the question attends to most); "none"
    stitches the blobs as they are; others in docs/accuracy.md. Also a per-call option."""
    quantize: Literal["int8", "bf16"] | None = None
    """Decode with quantised weights: faster, answers may drift (see GenerationConfig)."""
    draft: Literal["int8", "bf16"] | None = None
    """Quantised drafts verified in full precision: full-precision answers, often faster."""
    streaming: bool = False
    """Stream through `_stream` even when invoked (LangChain's standard flag)."""
    chunks: list[str] = Field(default_factory=list)
    """Texts to look for in every prompt, besides those in the registry."""
    registry: ChunkRegistry | None = Field(default=None, exclude=True)
    """Where the vector store wrapper records document texts (None: the engine's own,
    `ChunkRegistry.for_engine`, shared by every adapter built on the engine)."""
    namespace: str | None = None
    """The store namespace (a tenant) to read and write blobs in: the engine's view
    `engine.namespaced(namespace)`; give the vector store wrapper the same one. None: the
    engine's own."""
    encode_missing: bool = False
    """Encode and store blobs for looked-for texts that have none yet (first use pays)."""
    check_fingerprint: bool = True
    """Raise FingerprintMismatch when the prompt holds documents ingested for another model."""

    _engine: TurboRAGEngine | None = PrivateAttr(default=None)

    @field_validator("recovery")
    @classmethod
    def _known_recovery(cls, spec: str | None) -> str | None:
        Request("", recovery=spec)  # a bad spec fails here (checked there), not at the first call
        return spec

    @model_validator(mode="after")
    def _known_loading(self):
        # an unknown or absent device, a bad dtype or from_pretrained argument fails here,
        # before any load (ModelConfig checks them)
        self.loading()
        return self

    # ---- engine ---------------------------------------------------------------------------
    def loading(self) -> ModelConfig:
        """How the model is loaded when no engine is given (checked there)."""
        return ModelConfig(device=self.device, dtype=self.dtype, model_kwargs=self.model_kwargs,
                           tokenizer_kwargs=self.tokenizer_kwargs)

    def get_engine(self) -> TurboRAGEngine:
        engine = self.engine
        if engine is None:
            if self._engine is None:
                self._engine = shared_engine(self.model_name, self.loading())
            engine = self._engine
        return engine if self.namespace is None else engine.namespaced(self.namespace)

    def get_token_ids(self, text: str) -> list[int]:
        """`text`'s token ids under the model's own tokenizer (LangChain's `get_num_tokens`
        counts these): offline, and without loading the weights when no engine is up yet."""
        custom = getattr(self, "custom_get_token_ids", None)
        if custom is not None:  # LangChain's own override still wins
            return custom(text)
        engine = self.engine or self._engine
        tokenizer = engine.tokenizer if engine is not None else shared_tokenizer(self.model_name)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def get_registry(self) -> ChunkRegistry:
        if self.registry is not None:
            return self.registry
        return ChunkRegistry.for_engine(self.get_engine())

    @property
    def resolved_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        if self.engine is not None:
            return self.engine.loaded.name
        return "smollm2-135m-instruct"

    def render_prompt(self, value) -> str:
        """The prompt text this model sees for a formatted LangChain prompt value."""
        return value.to_string()

    def add_prompt(self, prompt, context_key: str = "context") -> str:
        """Encode chunks also right after the head of `prompt` (a LangChain prompt template
        whose `context_key` takes the retrieved documents), as this model renders it; returns
        that head. The first chunk of a prompt made from the template is then stitched from
        that blob, exactly as a full prefill computes it (core/library.py, lead blobs). Call it
        before ingesting: chunks ingested before get theirs when a prompt first needs it."""
        if context_key not in prompt.input_variables:
            raise ValueError(f"the prompt has no {{{context_key}}} for the retrieved documents "
                             f"(it takes {sorted(prompt.input_variables)}): name the one that "
                             "does as context_key")
        values = {v: VALUE_MARKER for v in prompt.input_variables}
        values[context_key] = CONTEXT_MARKER
        return self.get_engine().add_prompt(self.render_prompt(prompt.format_prompt(**values)))

    # ---- one call -------------------------------------------------------------------------
    def decoding_options(self, call: dict) -> dict:
        return {"quantize": call.get("quantize", self.quantize),
                "draft": call.get("draft", self.draft)}

    def candidate_chunks(self, engine: TurboRAGEngine, prompt: str, call: dict) -> list[str]:
        """Texts the engine should look for in `prompt`.

        Registry texts are filtered to those the prompt contains, so `cache_misses` counts
        documents that are in the prompt but have no (current) blob: never-ingested or edited.
        With `check_fingerprint`, documents ingested for another model raise
        FingerprintMismatch (the registry's check, core/registry.py, and for `Document`s passed
        in `chunks`, their recorded metadata).
        """
        explicit = [*self.chunks, *chunk_texts(call.get("chunks"))]
        if self.check_fingerprint:
            for doc in call.get("chunks") or ():
                if isinstance(doc, Document):
                    check_metadata(engine, doc.metadata, "a document passed in `chunks`")
        found = self.get_registry().found_in(
            prompt, fingerprint=engine.fingerprint if self.check_fingerprint else None)
        return list(dict.fromkeys([*explicit, *found]))

    def start(self, prompt: str, stop: list[str] | None, kwargs: dict) -> GenerationStream:
        call = call_kwargs(self, kwargs, _CALL_KWARGS)
        if call.get("model") not in (None, self.resolved_model_name):
            raise ValueError(f"{type(self).__name__} runs {self.resolved_model_name!r}; a per-call "
                             f"model ({call['model']!r}) is not supported: make another instance")
        engine = self.get_engine()
        mode = call.get("mode", self.mode)
        chunks = self.candidate_chunks(engine, prompt, call) if mode == "turbo" else []
        return engine.stream(prompt, chunks=chunks, config=self.generation_config(stop, call),
                             mode=mode, encode_missing=call.get("encode_missing",
                                                                self.encode_missing),
                             recovery=call.get("recovery", self.recovery))

    # ---- reporting ------------------------------------------------------------------------
    def response_metadata(self, stats: GenerationStats) -> dict:
        return {"model_name": self.resolved_model_name, "model_provider": "turborag",
                "finish_reason": stats.finish_reason, "turborag": stats.as_dict()}

    @staticmethod
    def usage_metadata(stats: GenerationStats) -> dict:
        return {"input_tokens": stats.prompt_tokens, "output_tokens": stats.new_tokens,
                "total_tokens": stats.prompt_tokens + stats.new_tokens,
                "input_token_details": {"cache_read": stats.reused_tokens}}

    # Shared by the chat model and the text LLM (the mixin comes first in their MRO, so super()
    # reaches LangChain's own implementation).
    @property
    def _identifying_params(self) -> dict[str, Any]:
        return self.identifying()

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any):
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "turborag"
        params["ls_model_name"] = kwargs.get("model") or self.resolved_model_name
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def identifying(self) -> dict[str, Any]:
        return {"model_name": self.resolved_model_name, "mode": self.mode,
                "temperature": self.temperature, "max_tokens": self.max_tokens,
                "top_p": self.top_p, "top_k": self.top_k}
