"""The engines adapters share when they are given none: one per model and way of loading it.

    engine = shared_engine("qwen2.5-coder-0.5b-instruct", ModelConfig(device="cuda"))

Every framework adapter built without an engine (a LlamaIndex LLM, postprocessor or vector
store; a LangChain chat model or vector store) takes the process's engine for its model, so a
model loads once however many adapters ask for it by name, and adapters of one model meet in
its store and chunk registry without being introduced. An adapter that asks for its own store
or encoding builds its own engine instead.
"""

from __future__ import annotations

import dataclasses
import threading

from .config import EngineConfig
from .engine import TurboRAGEngine
from .models import ModelConfig

__all__ = ["shared_engine"]

_ENGINES: dict[tuple[str | None, str], TurboRAGEngine] = {}
_LOCK = threading.Lock()


def shared_engine(model: str | None = None, loading: ModelConfig | None = None) -> TurboRAGEngine:
    """The process's engine of `model` (None: the bundled default) loaded as `loading` says
    (device, dtype, from_pretrained arguments), with the default store and encoding; made on
    first use."""
    loading = dataclasses.replace(loading or ModelConfig(), progress=False)
    key = (model, repr(loading))  # the config holds dicts: its repr is its identity here
    with _LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            engine = _ENGINES[key] = TurboRAGEngine(model, config=EngineConfig(model=loading))
        return engine
