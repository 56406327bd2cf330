"""The async bridge of both adapters, `core/async_iter.py`, importable here as before."""

from ..core.async_iter import iterate_in_thread

__all__ = ["iterate_in_thread"]
