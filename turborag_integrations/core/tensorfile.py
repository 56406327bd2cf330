"""Writing a safetensors file of small tensors (an adapter, a chunk encoder) atomically.

Readers see the old file or the complete new one, never part of either; the file is readable by
everyone, as a shared artefact should be (mkstemp makes it private).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str]) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
