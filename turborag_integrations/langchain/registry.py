"""The chunk registry (see core/registry.py), importable here as before.

`ChunkRegistry` is the core class: one registry per engine, texts of 32 characters or more,
for both frameworks. `default_registry()` is deprecated.
"""

import warnings

from ..core.registry import ChunkRegistry, RegisteredText

_PROCESS_WIDE = ChunkRegistry()


def default_registry() -> ChunkRegistry:
    """Deprecated: the process-wide registry that adapters shared before they shared one per
    engine (`ChunkRegistry.for_engine(engine)`). Adapters use it only when it is passed to them
    as `registry=`."""
    warnings.warn("default_registry() is deprecated: adapters share one registry per engine "
                  "(ChunkRegistry.for_engine(engine)); pass registry= to share another",
                  DeprecationWarning, stacklevel=2)
    return _PROCESS_WIDE


__all__ = ["ChunkRegistry", "RegisteredText", "default_registry"]
