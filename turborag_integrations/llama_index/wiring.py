"""How the LlamaIndex adapters find their engine and their chunk registry.

Every adapter built on an engine shares that engine's registry (`ChunkRegistry.for_engine`, see
core/registry.py) unless it is given one, so the vector store, the postprocessor and the LLM
meet without being introduced.
"""

from __future__ import annotations

from ..core.registry import ChunkRegistry


def resolve_engine(engine):
    """Accept an engine, or anything that holds one (a TurboRAGLLM); None: the process's shared
    engine of the bundled model (core/shared.py)."""
    if engine is None:
        from ..core.shared import shared_engine

        return shared_engine()
    inner = getattr(engine, "engine", None)
    if inner is not None and not hasattr(engine, "encode_chunks"):
        return inner
    if not hasattr(engine, "encode_chunks"):
        raise TypeError(f"expected a TurboRAGEngine or a TurboRAGLLM, got {type(engine).__name__}")
    return engine


class EngineBound:
    """The `engine` and `registry` of an adapter (its pydantic class declares the private
    attributes `_engine` and `_registry`)."""

    def _bind(self, engine, registry: ChunkRegistry | None, namespace: str | None = None) -> None:
        """Bind to `engine` (see `resolve_engine`; in `namespace`, its view of that store
        namespace) and to `registry`; None: the registry of a TurboRAGLLM given as `engine`,
        else the engine's own."""
        if registry is None and namespace is None:
            registry = getattr(engine, "registry", None)
        self._engine = resolve_engine(engine)
        if namespace is not None:
            self._engine = self._engine.namespaced(namespace)
        self._registry = (registry if registry is not None
                          else ChunkRegistry.for_engine(self._engine))

    @property
    def engine(self):
        return self._engine

    @property
    def registry(self) -> ChunkRegistry:
        return self._registry

    def _register(self, texts, *, prepared: bool = True) -> None:
        """Record `texts` as chunks a prompt may contain; `prepared` ones (their blobs made by
        this engine) with its fingerprint, so that an engine running another model refuses
        them."""
        if prepared:
            fp = self._engine.fingerprint
            self._registry.add(texts, fp.id, fp.describe())
        else:
            self._registry.add(texts)
