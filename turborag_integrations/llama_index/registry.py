"""The shared chunk registry (see core/registry.py), re-exported for LlamaIndex users."""

from ..core.registry import ChunkRegistry, RegisteredText

__all__ = ["ChunkRegistry", "RegisteredText"]
