"""LoRA adapters for stitched prompts: a small file of low-rank weight deltas, merged at load.

A model fine-tuned with TurboRAG's attention pattern (training/finetune.py) answers from stitched
chunk caches as well as from a full prefill. Its LoRA deltas are saved alone — a few MB of
safetensors instead of a whole model — together with a digest of the base weights they were
trained on, and merged into those weights when an engine loads (W += scale · B·A). Merging
changes the weights, so the engine's fingerprint (a digest of every weight) changes with it:
blobs of the base model and of the adapted model never mix (invariant 7).

Runtime needs neither peft nor training code: the file holds plain tensors.

    apply_adapter(model, "smollm2-turbo.safetensors")   # raises AdapterMismatch on another base
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from . import environment
from .kv.blob import weights_digest
from .tensorfile import read_tensors, save_tensors
from .errors import AdapterMismatch

FORMAT = "turborag-lora/1"
# Adapters shipped with the package, for the bundled models they were trained on.
BUNDLED = {"smollm2-135m-instruct": "smollm2-135m-instruct.safetensors"}
_APPLIED = "_turborag_adapter"  # attribute set on a model an adapter was merged into


def bundled_adapter(model_name: str) -> Path | None:
    """The adapter shipped for a bundled model, or None."""
    return environment.bundled_file("adapters", BUNDLED.get(model_name))


def save_adapter(path: str | Path, deltas: dict[str, tuple[torch.Tensor, torch.Tensor, float]],
                 base_weights: str, meta: dict | None = None) -> Path:
    """Write {module name: (A [r, in], B [out, r], scale)} atomically.

    A and B are stored in float16 (half the bytes; the merged delta is what the fingerprint sees,
    so rounding here changes nothing downstream of loading)."""
    path = Path(path)
    tensors, scales = {}, {}
    for name, (a, b, scale) in deltas.items():
        tensors[f"{name}.lora_A"] = a.detach().to("cpu", torch.float16).contiguous()
        tensors[f"{name}.lora_B"] = b.detach().to("cpu", torch.float16).contiguous()
        scales[name] = float(scale)
    header = {"format": FORMAT, "base_weights": base_weights, "scales": json.dumps(scales),
              "meta": json.dumps(meta or {})}
    return save_tensors(path, tensors, header)


def read_adapter(path: str | Path) -> tuple[dict, dict[str, tuple[torch.Tensor, torch.Tensor, float]]]:
    """(header, deltas) of an adapter file; raises AdapterMismatch when it is not one."""
    path = Path(path)
    header, tensors = read_tensors(path, FORMAT, "adapter", AdapterMismatch)
    scales = json.loads(header.get("scales", "{}"))
    deltas = {}
    for name, scale in scales.items():
        try:
            deltas[name] = (tensors[f"{name}.lora_A"], tensors[f"{name}.lora_B"], float(scale))
        except KeyError:
            raise AdapterMismatch(f"{path}: module {name} lacks its lora_A/lora_B tensors") from None
    return header, deltas


def apply_adapter(model, path: str | Path, *, check_base: bool = True) -> dict:
    """Merge the adapter at `path` into `model` in place; return its header.

    Refuses (AdapterMismatch, before changing anything) an adapter trained on other base weights
    or for modules this model lacks or shapes it does not have. Merging the same file twice into
    one model is a no-op; merging a second, different adapter is refused.
    """
    header, deltas = read_adapter(path)
    applied = getattr(model, _APPLIED, None)
    file_id = header.get("base_weights", "") + "|" + Path(path).name
    if applied is not None:
        if applied == file_id:
            return header
        raise AdapterMismatch(f"this model already has another adapter merged ({applied}); "
                              "load a fresh model to use a different one")
    if check_base:
        base = weights_digest(model)
        if base != header.get("base_weights"):
            meta = json.loads(header.get("meta", "{}"))
            raise AdapterMismatch(
                f"adapter {path} was trained on other weights (base model "
                f"{meta.get('base_model', '?')}, weights {header.get('base_weights', '?')[:12]}); "
                f"this model's weights are {base[:12]}. Use it with the model it was made for, "
                "or pass adapter=None.")
    modules = dict(model.named_modules())
    plan = []
    for name, (a, b, scale) in deltas.items():
        module = modules.get(name)
        weight = getattr(module, "weight", None)
        if weight is None:
            raise AdapterMismatch(f"adapter {path} targets {name}, which this model does not have")
        if tuple(weight.shape) != (b.shape[0], a.shape[1]) or a.shape[0] != b.shape[1]:
            raise AdapterMismatch(f"adapter {path}: {name} is {tuple(weight.shape)} here, the "
                                  f"adapter's delta is {(b.shape[0], a.shape[1])}")
        plan.append((weight, a, b, scale))
    with torch.no_grad():
        for weight, a, b, scale in plan:
            delta = (b.float() @ a.float()) * scale
            weight.add_(delta.to(device=weight.device, dtype=weight.dtype))
    setattr(model, _APPLIED, file_id)
    return header
