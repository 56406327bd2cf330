"""Writing a safetensors file of small tensors (a chunk encoder) atomically.

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


def read_tensors(path: str | Path, fmt: str, kind: str,
                 error: type[Exception]) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(metadata, tensors) of a file written by `save_tensors` with metadata format `fmt`;
    raises `error` naming the file when it is missing, unreadable or of another format."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise error(f"no {kind} file at {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # safetensors raises several types for a bad file
        raise error(f"{path} is not a readable safetensors {kind} file: {exc}") from None
    if header.get("format") != fmt:
        raise error(f"{path} is not a TurboRAG {kind} file (format {header.get('format')!r}, "
                    f"expected {fmt!r})")
    return header, tensors
