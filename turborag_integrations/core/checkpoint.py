"""A model's fingerprint read from its checkpoint folder, without building the model.

`fingerprint_model` (kv/blob.py) digests a loaded model: its config, every tensor of its
state_dict in the dtype it was loaded in, and its tokenizer. A process that only serves blobs —
vLLM's connector, which runs beside a model vLLM loaded its own way — needs the same fingerprint
without an HF copy of the model: at 70B that copy would not fit beside vLLM's.

`fingerprint_checkpoint` computes it from the folder: the config and tokenizer as transformers
reads them, and the state_dict digest rebuilt tensor by tensor from the safetensors files —
each tensor cast to the serving dtype as loading casts it, a tied output embedding added under
its own name as state_dict lists it — one tensor in memory at a time. It equals
`fingerprint_model` of the model loaded from the same folder in the same dtype (tested on the
bundled models and tiny ones, tied and untied). Where a model type renames or fuses tensors at
load, the digests differ and blobs are simply not found (never wrongly used):
`fingerprint_model` stays the definition.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open

from .kv.blob import Fingerprint, digest_tensor, fingerprint_parts

__all__ = ["CheckpointError", "checkpoint_weights_digest", "fingerprint_checkpoint"]


class CheckpointError(ValueError):
    """A folder that is not a safetensors checkpoint this module can digest."""


def _tensor_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no *.safetensors weights: convert the checkpoint "
                              "to safetensors, or fingerprint the loaded model")
    return files


def checkpoint_weights_digest(folder: str | Path, dtype: torch.dtype, config) -> str:
    """`weights_digest` of the model `folder` loads as, in `dtype`, from its files alone."""
    folder = Path(folder)
    where: dict[str, Path] = {}
    for path in _tensor_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                where[name] = path
    # a tied output layer shares the input embedding's tensor; state_dict lists it under both
    # names, the file under one
    tied = getattr(config, "tie_word_embeddings", False)
    aliases = {}
    if tied and "lm_head.weight" not in where and "model.embed_tokens.weight" in where:
        aliases["lm_head.weight"] = "model.embed_tokens.weight"
    h = xxhash.xxh3_128()
    handles: dict[Path, object] = {}
    try:
        for name in sorted([*where, *aliases]):
            source = aliases.get(name, name)
            path = where[source]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt").__enter__()
            t = handles[path].get_tensor(source)
            digest_tensor(h, name, t.to(dtype) if t.is_floating_point() else t)
            del t
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return h.hexdigest()


def fingerprint_checkpoint(folder: str | Path, dtype: torch.dtype | str, name: str | None = None,
                           tokenizer=None, config=None) -> Fingerprint:
    """The fingerprint `fingerprint_model` gives the model loaded from `folder` in `dtype`
    (`tokenizer` and `config`: the folder's, when the caller has them already)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = Path(folder)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.replace("torch.", ""))
    if config is None:
        config = AutoConfig.from_pretrained(folder)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return fingerprint_parts(config, tokenizer, checkpoint_weights_digest(folder, dtype, config),
                             dtype, name or str(folder))
