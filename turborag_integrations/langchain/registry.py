"""The shared chunk registry (see core/registry.py) with LangChain's defaults.

LangChain documents shorter than 32 characters are not registered: they would match inside
other words of a prompt. Chat models and vector store wrappers share one process-wide registry
unless given their own.
"""

from ..core.registry import ChunkRegistry as _CoreRegistry
from ..core.registry import RegisteredText


class ChunkRegistry(_CoreRegistry):
    def __init__(self, capacity: int = 4096, min_chars: int = 32):
        super().__init__(capacity=capacity, min_chars=min_chars)


_DEFAULT = ChunkRegistry()


def default_registry() -> ChunkRegistry:
    """The process-wide registry that wrappers and chat models share unless given their own."""
    return _DEFAULT


__all__ = ["ChunkRegistry", "RegisteredText", "default_registry"]
